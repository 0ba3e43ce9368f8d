"""Cache-aware routing with KV tiers (``xservice/policies/routing.py``): an L2 / L3 hit counts, priced by
the instance's measured load time of a block against its measured time to compute one."""

from __future__ import annotations

import pytest

from xservice.cluster.kv_index import TierKVIndex
from xservice.policies.routing import (
    DEFAULT_TIER_COST,
    CacheAwarePolicy,
    InstanceSnapshot,
    RouteRequest,
    effective_blocks,
    tier_cost,
)

A, B = InstanceSnapshot("a"), InstanceSnapshot("b")


def test_tier_cost_is_load_over_recompute_capped_at_one() -> None:
    assert tier_cost(2.0, 1.0, 16, 0.3) == pytest.approx(2.0 / 16)
    assert tier_cost(100.0, 1.0, 16, 0.3) == 1.0  # slower than computing: worth nothing
    assert tier_cost(None, 1.0, 16, 0.3) == 0.3  # not measured yet
    assert tier_cost(2.0, None, 16, 0.3) == 0.3


def test_effective_blocks_discounts_each_tier_by_its_price() -> None:
    req = RouteRequest(10, {"a": 2}, tier_blocks={"a": (5, 9)}, tier_cost={"a": (0.1, 0.5)})
    assert effective_blocks(req, "a") == pytest.approx(2 + 3 * 0.9 + 4 * 0.5)
    assert effective_blocks(RouteRequest(10, {"a": 2}), "a") == 2  # no tiers: L1 only
    assert effective_blocks(RouteRequest(10, {}, tier_blocks={"b": (0, 6)}), "b") == pytest.approx(
        6 * (1 - DEFAULT_TIER_COST[1])
    )


def test_a_cheap_l3_hit_wins_over_a_cold_instance_and_an_expensive_one_does_not() -> None:
    policy = CacheAwarePolicy(match_weight=2.0)
    cheap = RouteRequest(8, {}, tier_blocks={"a": (0, 0), "b": (0, 8)}, tier_cost={"b": (0.05, 0.1)})
    assert policy.select(cheap, [A, B]) == "b"
    costly = RouteRequest(8, {}, tier_blocks={"a": (0, 0), "b": (0, 8)}, tier_cost={"b": (1.0, 1.0)})
    assert policy.select(costly, [A, B]) == "a"  # a tie on worth: the name decides


def test_an_l1_hit_beats_the_same_prefix_in_l3() -> None:
    policy = CacheAwarePolicy(match_weight=2.0)
    req = RouteRequest(8, {"a": 8}, tier_blocks={"a": (8, 8), "b": (0, 8)}, tier_cost={"b": (0.1, 0.3)})
    assert policy.select(req, [A, B]) == "a"


def test_tier_index_runs_through_l1_host_disk_and_the_store() -> None:
    index = TierKVIndex()
    index.apply("a", True, {"host": [2, 3], "disk": [4]}, {})
    index.apply("b", False, {"store": [1, 2, 3, 4, 5]}, {})
    hashes = [1, 2, 3, 4, 5, 6]
    got = index.match(hashes, {"a": 1}, ["a", "b"], store_users={"a", "b"})
    assert got["a"] == (3, 5)  # L1 1, host 2-3, disk 4, then the store's 5
    assert got["b"] == (0, 5)  # nothing local: the store's run
    assert index.match(hashes, {"a": 1}, ["a"], store_users=set())["a"] == (3, 4)  # a without the store
    index.apply("a", False, {}, {"host": [3]})
    assert index.match(hashes, {"a": 1}, ["a"], store_users=set())["a"] == (2, 2)
    assert index.counts("a") == {"host": 1, "disk": 1}
    index.drop("a")
    assert index.counts("a") == {"host": 0, "disk": 0}
