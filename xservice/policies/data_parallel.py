"""Which data-parallel rank takes a new request (pure): the rank that served the same prompt start
before, while it is not much busier than the rest (its prefix cache holds that start); otherwise the
one with the fewest requests in flight, ties going round-robin so an idle instance spreads a burst
over all ranks."""

from __future__ import annotations

from collections.abc import Sequence

AFFINITY_SLACK = 2  # in-flight requests a rank may exceed the least-loaded one by and keep its prefixes


def pick_rank(inflight: Sequence[int], last: int, affinity: int | None = None) -> int:
    """The rank for the next request, given each rank's requests in flight, the rank picked last and
    the rank that last served this prompt's first block (None: none did)."""
    fewest = min(inflight)
    if affinity is not None and inflight[affinity] <= fewest + AFFINITY_SLACK:
        return affinity
    n = len(inflight)
    for step in range(1, n + 1):
        rank = (last + step) % n
        if inflight[rank] == fewest:
            return rank
    raise AssertionError("unreachable: some rank has the fewest")
