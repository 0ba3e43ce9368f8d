"""Where a request prefills (``xservice/policies/prfaas/routing.py``), in the paper's two bandwidth
regimes (section 3.4.3)."""

from __future__ import annotations

from xservice.policies.prfaas import LOCAL, PRFAAS, route_prefill


def test_the_threshold_on_the_uncached_length() -> None:
    assert route_prefill(30000, 20000).cluster == PRFAAS
    assert route_prefill(20000, 20000).cluster == LOCAL  # l <= t stays local
    # a long prompt mostly cached locally computes only its increment, locally
    r = route_prefill(30000, 20000, cached_local=15000)
    assert (r.cluster, r.uncached_tokens, r.reused_tokens) == (LOCAL, 15000, 15000)
    assert route_prefill(30000, 20000, prfaas_available=False).cluster == LOCAL


def test_scarce_bandwidth_counts_each_clusters_cache_for_itself() -> None:
    # the PrfaaS cluster holds 25K of it: with scarce bandwidth that does not help a local prefill
    r = route_prefill(30000, 20000, cached_local=0, cached_prfaas=25000, bandwidth_scarce=True)
    assert (r.cluster, r.uncached_tokens, r.reuse_from, r.transfer_prefix) == (PRFAAS, 5000, PRFAAS, False)


def test_abundant_bandwidth_uses_the_longest_prefix_anywhere() -> None:
    # the increment past the PrfaaS cluster's 25K is short: local prefill, the prefix crosses the link
    r = route_prefill(30000, 20000, cached_local=0, cached_prfaas=25000, bandwidth_scarce=False)
    assert (r.cluster, r.uncached_tokens, r.reuse_from, r.transfer_prefix) == (LOCAL, 5000, PRFAAS, True)
    # the longest prefix is local and the increment long: PrfaaS computes it from the local prefix
    r = route_prefill(60000, 20000, cached_local=10000, cached_prfaas=5000, bandwidth_scarce=False)
    assert (r.cluster, r.uncached_tokens, r.reuse_from, r.transfer_prefix) == (PRFAAS, 50000, LOCAL, True)
    # nothing cached anywhere: no prefix transfer
    assert not route_prefill(60000, 20000, bandwidth_scarce=False).transfer_prefix
