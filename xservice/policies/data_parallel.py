"""Which data-parallel rank takes a new request (pure): the one with the fewest requests in flight,
ties going round-robin so an idle instance spreads a burst over all ranks."""

from __future__ import annotations

from collections.abc import Sequence


def pick_rank(inflight: Sequence[int], last: int) -> int:
    """The rank for the next request, given each rank's requests in flight and the rank picked last."""
    fewest = min(inflight)
    n = len(inflight)
    for step in range(1, n + 1):
        rank = (last + step) % n
        if inflight[rank] == fewest:
            return rank
    raise AssertionError("unreachable: some rank has the fewest")
