"""Routing policies on snapshots: pure, deterministic, no I/O."""

from __future__ import annotations

import pytest

from xservice.policies import (
    CacheAwarePolicy,
    InstanceSnapshot,
    LeastLoadPolicy,
    RoundRobinPolicy,
    RouteRequest,
    make_policy,
)

A, B, C = (InstanceSnapshot(n) for n in ("a", "b", "c"))


def test_round_robin_cycles_in_name_order_and_skips_missing_candidates() -> None:
    policy = RoundRobinPolicy()
    picks = [policy.select(RouteRequest(), [C, A, B]) for _ in range(4)]
    assert picks == ["a", "b", "c", "a"]
    assert policy.select(RouteRequest(), [A, C]) == "c"  # after "a": next in order among the live ones


def test_least_load_uses_the_larger_of_inflight_and_reported_load_then_name() -> None:
    busy = InstanceSnapshot("a", num_inflight=3)
    reported = InstanceSnapshot("b", num_running=1, num_waiting=1)
    idle = InstanceSnapshot("c")
    assert LeastLoadPolicy().select(RouteRequest(), [busy, reported, idle]) == "c"
    assert LeastLoadPolicy().select(RouteRequest(), [busy, reported]) == "b"
    assert LeastLoadPolicy().select(RouteRequest(), [B, A]) == "a"  # tie: name


def test_cache_aware_prefers_the_prefix_holder_unless_it_is_much_busier() -> None:
    policy = CacheAwarePolicy(match_weight=2.0)
    holder = InstanceSnapshot("b", num_inflight=1)
    req = RouteRequest(num_blocks=4, matched_blocks={"b": 4})
    assert policy.select(req, [A, holder]) == "b"  # 2*1 - 1 = 1 > 0
    partial = RouteRequest(num_blocks=4, matched_blocks={"b": 1})
    assert policy.select(partial, [A, holder]) == "a"  # 2*0.25 - 1 < 0
    scores = policy.scores(req, [A, holder])
    assert scores == {"a": 0.0, "b": 1.0}


def test_cache_aware_ties_go_to_least_load_then_name() -> None:
    policy = CacheAwarePolicy(match_weight=1.0)
    loaded = InstanceSnapshot("a", num_inflight=2)
    # a: 1*1 - 1 = 0; c: 0 - 0 = 0 -> tie -> c has the lower load
    assert policy.select(RouteRequest(num_blocks=2, matched_blocks={"a": 2}), [loaded, C]) == "c"
    assert policy.select(RouteRequest(num_blocks=0), [C, B]) == "b"  # nothing cached, all idle: name


def test_make_policy_and_errors() -> None:
    assert make_policy("cache_aware", 3.0).match_weight == 3.0
    assert make_policy("round_robin").name == "round_robin"
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")
    with pytest.raises(ValueError, match="no candidate"):
        LeastLoadPolicy().select(RouteRequest(), [])


def test_pd_pairs_the_least_loaded_prefill_with_the_decode_holding_the_prompt() -> None:
    from xservice.policies import PDPair, PDPolicy

    snaps = [
        InstanceSnapshot("p0", role="prefill", num_inflight=2),
        InstanceSnapshot("p1", role="prefill", num_running=1),
        InstanceSnapshot("d0", role="decode"),
        InstanceSnapshot("d1", role="decode", num_inflight=1),
        InstanceSnapshot("m0", role="mixed"),
    ]
    policy = PDPolicy(match_weight=2.0)
    assert policy.select(RouteRequest(num_blocks=4), snaps) == PDPair("p1", "d0")  # no match: least load
    held = RouteRequest(num_blocks=4, matched_blocks={"d1": 4, "p0": 4})
    assert policy.select(held, snaps) == PDPair("p1", "d1")  # 2 * 1.0 - 1 beats 0 - 0
    assert policy.select(held, snaps[2:]) == PDPair(None, "d1")  # no prefill: the caller runs it plain
    assert policy.select(held, snaps[:2]) == PDPair("p1", None)


# ---------------------------------------------------------------------- restart policy


def test_restart_backoff_doubles_with_recent_restarts_and_caps() -> None:
    from xservice.policies import RestartPolicy

    p = RestartPolicy(max_restarts=10, window_s=100.0, initial_backoff_s=1.0, max_backoff_s=5.0)
    assert p.delay([], 0.0) == 1.0
    assert p.delay([1.0], 2.0) == 2.0
    assert p.delay([1.0, 2.0], 3.0) == 4.0
    assert p.delay([1.0, 2.0, 3.0], 4.0) == 5.0  # capped
    assert p.delay([1.0, 2.0, 3.0], 150.0) == 1.0  # old restarts left the window


def test_restart_policy_gives_up_past_its_budget_in_the_window() -> None:
    from xservice.policies import RestartPolicy

    p = RestartPolicy(max_restarts=2, window_s=60.0)
    assert p.delay([10.0], 20.0) is not None
    assert p.delay([10.0, 15.0], 20.0) is None
    assert p.delay([10.0, 15.0], 80.0) is not None  # the first fell out of the window
    assert RestartPolicy(max_restarts=0).delay([], 0.0) is None  # restarts off
