"""``StreamLedger``: the requests whose deltas one engine still owes us, in send order.

A client stream must never hang. Two ways an engine can stop streaming a request without dying:
it aborts the request although nobody asked (a drain deadline, another service's ``Hello``), or the
request's outputs never reach us (frames dropped, an engine that forgot it). The ledger finds both:
an ``abort`` finish the service did not ask for is a failure of the request; and an audit (the
engine lists the requests it still runs) reveals every request sent *before* the audit that the
engine no longer runs although its last delta never arrived. The audit is exact, with no timing
guess: one socket carries requests in order to the engine, another carries its outputs in order
back, so by the time the audit's answer is routed every delta the engine sent before it was too.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from xengine.api.messages import CompletionDelta

UNASKED_ABORT = "the engine aborted the request although the service did not ask it to"
LOST = "the engine no longer runs the request but never sent its end (its output stream was lost)"


@dataclass
class _Entry:
    seq: int  # position in the send order
    num_seqs: int  # the request's n: sequences that must finish
    finished: set[int] = field(default_factory=set)
    aborting: bool = False  # the service asked the engine to abort it


class StreamLedger:
    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def opened(self, req_id: str, num_seqs: int) -> None:
        """``req_id`` is about to be sent; ``num_seqs`` sequences of it must finish."""
        self._entries[req_id] = _Entry(next(self._order), num_seqs)

    def mark(self) -> int:
        """A point in the send order (taken just before an audit call is sent)."""
        return next(self._order)

    def aborting(self, req_id: str) -> None:
        """The service asks the engine to abort ``req_id``: its ``abort`` finish is expected."""
        entry = self._entries.get(req_id)
        if entry is not None:
            entry.aborting = True

    def aborting_all(self) -> None:
        """The service shuts the engine down: aborts at its drain deadline are expected."""
        for entry in self._entries.values():
            entry.aborting = True

    def on_delta(self, delta: CompletionDelta) -> str | None:
        """Account one delta; returns why the request failed when the delta ends it unasked."""
        entry = self._entries.get(delta.req_id)
        if entry is None or delta.finish_reason is None:
            return None
        if delta.finish_reason == "abort" and not entry.aborting:
            del self._entries[delta.req_id]
            return UNASKED_ABORT
        entry.finished.add(delta.index)
        if delta.finish_reason == "error" or len(entry.finished) >= entry.num_seqs:
            del self._entries[delta.req_id]
        return None

    def lost(self, mark: int, live_req_ids: Iterable[str]) -> list[str]:
        """Requests sent before ``mark`` that the engine does not run (``live_req_ids``) although
        their end never arrived; they leave the ledger."""
        live = set(live_req_ids)
        out = [r for r, e in self._entries.items() if e.seq < mark and r not in live]
        for req_id in out:
            del self._entries[req_id]
        return out

    def clear(self) -> None:
        self._entries.clear()
