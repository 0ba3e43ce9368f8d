"""What the PrfaaS link carries, as the service sees it: each KV import from a PrfaaS instance into a
local decode instance is one transfer (its bytes and the engine's own transfer time).

- ``sent_bytes``: the egress so far (a counter the scheduler differentiates);
- ``queued_bytes``: what transfers in flight are still to move (each counted at its export's size until
  it ends), and ``oldest_s``, how long the oldest of them has waited -- a backlog the link has not
  delivered yet, whatever its capacity;
- ``capacity_gbps``: the configured ``B_out``, or less when the link, busy, delivered less -- bytes
  over the union of the transfers' intervals in the last ``window_s`` (concurrent transfers share it),
  once it was busy at least ``min_busy_s`` of them.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterator


class LinkMeter:
    def __init__(self, configured_gbps: float, window_s: float = 10.0, min_busy_s: float = 0.5) -> None:
        self.configured_gbps = configured_gbps
        self.window_s, self.min_busy_s = window_s, min_busy_s
        self.sent_bytes = 0.0
        self.queued_bytes = 0.0
        self.num_transfers = 0
        self._inflight: dict[int, tuple[float, float]] = {}  # token -> (started, expected bytes)
        self._next = 0
        self._recent: deque[tuple[float, float, float]] = deque()  # (start, end, bytes)

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def begin(self, expected_bytes: float, now: float | None = None) -> int:
        """A transfer starts; returns its token (pass it to ``end``)."""
        self._next += 1
        self._inflight[self._next] = (time.monotonic() if now is None else now, expected_bytes)
        self.queued_bytes += expected_bytes
        return self._next

    def oldest_s(self, now: float | None = None) -> float:
        """How long the oldest transfer in flight has waited (0: none)."""
        now = time.monotonic() if now is None else now
        return max((now - t for t, _ in self._inflight.values()), default=0.0)

    def end(self, token: int, num_bytes: float, transfer_s: float, now: float | None = None) -> None:
        """It ended (``num_bytes`` moved in ``transfer_s``; 0 / 0 when it failed)."""
        now = time.monotonic() if now is None else now
        _, expected = self._inflight.pop(token, (now, 0.0))
        self.queued_bytes = max(0.0, self.queued_bytes - expected)
        if num_bytes > 0:
            self.sent_bytes += num_bytes
            self.num_transfers += 1
            self._recent.append((now - max(transfer_s, 0.0), now, float(num_bytes)))

    def delivered_gbps(self, now: float | None = None) -> float | None:
        """What the link delivered while busy in the last ``window_s`` (None: not busy long enough)."""
        now = time.monotonic() if now is None else now
        while self._recent and self._recent[0][1] < now - self.window_s:
            self._recent.popleft()
        busy, total, edge = 0.0, 0.0, -1.0
        for start, end, size in sorted(self._recent):
            total += size
            start = max(start, edge)
            if end > start:
                busy += end - start
                edge = end
        if busy < self.min_busy_s:
            return None
        return total * 8 / busy / 1e9

    def capacity_gbps(self, now: float | None = None) -> float:
        got = self.delivered_gbps(now)
        return self.configured_gbps if got is None else min(self.configured_gbps, got)


@contextlib.contextmanager
def transfer(meter: LinkMeter | None, expected_bytes: float) -> Iterator[dict[str, float] | None]:
    """Count one transfer on ``meter`` (None: nothing): set the yielded dict's ``bytes`` and ``seconds``
    when it succeeds."""
    if meter is None:
        yield None
        return
    token = meter.begin(expected_bytes)
    result: dict[str, float] = {"bytes": 0.0, "seconds": 0.0}
    try:
        yield result
    finally:
        meter.end(token, result["bytes"], result["seconds"])
