"""Where one request prefills (paper sections 3.3 and 3.4.3): on the PrfaaS cluster when its uncached
length exceeds the threshold, else on the local cluster's prefill instances.

Cache-aware, in the paper's two regimes. **Bandwidth scarce**: each cluster's prefix cache counts only
for that cluster -- the request is local when ``total - cached_local <= t`` (nothing crosses the link but
the prefill's own KV). **Bandwidth abundant**: the longest cached prefix anywhere counts
(``total - max(cached_local, cached_prfaas) <= t``), and when it sits in the other cluster than the one
that computes, it crosses the link first (``transfer_prefix``).
"""

from __future__ import annotations

from dataclasses import dataclass

LOCAL, PRFAAS = "local", "prfaas"


@dataclass(frozen=True)
class PrefillRoute:
    cluster: str  # LOCAL or PRFAAS
    uncached_tokens: int  # what that cluster computes
    reuse_from: str  # the cluster whose cached prefix it starts from
    reused_tokens: int
    transfer_prefix: bool  # the reused prefix crosses the link to the computing cluster first


def route_prefill(
    total_tokens: int,
    threshold: float,
    *,
    cached_local: int = 0,
    cached_prfaas: int = 0,
    bandwidth_scarce: bool = True,
    prfaas_available: bool = True,
) -> PrefillRoute:
    """The cluster request prefills on, and which cached prefix it reuses."""
    cached_local = max(0, min(cached_local, total_tokens - 1))
    cached_prfaas = max(0, min(cached_prfaas, total_tokens - 1))
    if bandwidth_scarce or not prfaas_available:
        if not prfaas_available or total_tokens - cached_local <= threshold:
            return PrefillRoute(LOCAL, total_tokens - cached_local, LOCAL, cached_local, False)
        return PrefillRoute(PRFAAS, total_tokens - cached_prfaas, PRFAAS, cached_prfaas, False)
    best_from = PRFAAS if cached_prfaas > cached_local else LOCAL
    best = max(cached_local, cached_prfaas)
    where = LOCAL if total_tokens - best <= threshold else PRFAAS
    return PrefillRoute(where, total_tokens - best, best_from, best, best_from != where and best > 0)
