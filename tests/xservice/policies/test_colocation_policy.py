"""The co-location policy and its roofline model over hand-built snapshots (pure)."""

from __future__ import annotations

import pytest

from xservice.policies.colocation import ColocationPolicy, RooflineModel, RooflineSpec, StrictInstance

# a 100M-parameter fp32 model on 2 threads: 400 MB of weights, 16 kB of KV per token
SPEC = RooflineSpec(
    peak_flops=160e9, mem_bw=15e9, weight_bytes=4e8, flops_per_token=2e8, kv_bytes_per_token=16e3
)


def test_roofline_is_memory_bound_for_small_batches_and_compute_bound_for_large():
    m = RooflineModel(SPEC)
    assert m.bottleneck(1, 100) == "memory"
    assert m.bottleneck(2000, 100) == "compute"
    assert SPEC.raw_step_s(1, 100) == pytest.approx((4e8 + 100 * 16e3) / 15e9)
    # more context, more KV read; more tokens, more compute once compute-bound
    assert SPEC.raw_step_s(8, 10_000) > SPEC.raw_step_s(8, 1000)
    assert SPEC.raw_step_s(4000, 100) > SPEC.raw_step_s(2000, 100)


def test_online_correction_learns_overhead_and_factor():
    m = RooflineModel(SPEC)
    assert not m.ready and m.predict(4, 400) == SPEC.raw_step_s(4, 400)
    for b, ctx in [(1, 100), (4, 800), (16, 4000), (32, 9000), (8, 2000), (2, 300)]:
        m.observe(b, ctx, 0, 0.005 + 1.5 * SPEC.raw_step_s(b, ctx))  # 5 ms overhead, 1.5x the roofline
    assert m.ready
    state = m.state()
    assert state["overhead_s"] == pytest.approx(0.005, rel=1e-3)
    assert state["factor"] == pytest.approx(1.5 / 1000, rel=1e-3)  # per raw millisecond
    assert m.predict(24, 6000) == pytest.approx(0.005 + 1.5 * SPEC.raw_step_s(24, 6000), rel=1e-4)


def fitted(overhead_s: float = 0.004, factor: float = 1.0) -> RooflineModel:
    m = RooflineModel(SPEC)
    for b, ctx in [(1, 100), (4, 800), (16, 4000), (32, 9000), (64, 20_000)]:
        m.observe(b, ctx, 0, overhead_s + factor * SPEC.raw_step_s(b, ctx))
    return m


def strict(
    name: str, online: int, offline: int, ctx: int, model=None, capacity: int = 1 << 62
) -> StrictInstance:
    return StrictInstance(name, model or fitted(), online, offline, ctx, capacity)


def test_offline_decode_joins_the_strict_instance_with_most_slack():
    policy = ColocationPolicy(tpot_slo_s=0.05, headroom=0.8)
    a, b = strict("d0", 8, 0, 20_000), strict("d1", 2, 0, 2000)
    choice = policy.select_offline_decode("p0", 300, [a, b])
    assert choice.strict and choice.name == "d1"
    assert choice.predicted_step_s is not None and choice.predicted_step_s <= 0.04


def test_offline_decode_stays_relaxed_when_every_strict_batch_would_miss_the_slo():
    policy = ColocationPolicy(tpot_slo_s=0.05, headroom=0.8)
    slow = fitted(overhead_s=0.039)  # already near the 40 ms budget at any batch
    choice = policy.select_offline_decode("p0", 300, [strict("d0", 1, 0, 100, slow)])
    assert not choice.strict and choice.name == "p0" and "SLO" in choice.reason


def test_headroom_decides_how_many_offline_sequences_join():
    """Admitting one at a time, the strict batch fills until the predicted step reaches the budget."""
    policy = ColocationPolicy(tpot_slo_s=0.05, headroom=0.8)
    model = fitted(overhead_s=0.01, factor=1.0)
    online, offline, ctx = 4, 0, 4 * 500
    while True:
        choice = policy.select_offline_decode("p0", 500, [strict("d0", online, offline, ctx, model)])
        if not choice.strict:
            break
        offline, ctx = offline + 1, ctx + 500
    assert offline > 0
    assert model.predict(online + offline, ctx) <= 0.04 < model.predict(online + offline + 1, ctx + 500)


def test_capacity_and_per_instance_cap_are_respected():
    policy = ColocationPolicy(tpot_slo_s=1.0, headroom=1.0, max_offline_per_instance=2)
    full = strict("d0", 0, 0, 900, capacity=1000)
    assert not policy.select_offline_decode("p0", 200, [full]).strict
    capped = strict("d1", 0, 2, 100)
    assert not policy.select_offline_decode("p0", 10, [capped]).strict


@pytest.mark.parametrize(
    "kw", [{"tpot_slo_s": 0}, {"tpot_slo_s": 0.1, "headroom": 0}, {"tpot_slo_s": 0.1, "headroom": 1.5}]
)
def test_bad_policy_parameters_are_refused(kw):
    with pytest.raises(ValueError):
        ColocationPolicy(**kw)


def with_offline(inst: StrictInstance, offline: list[tuple[str, int]], **kw) -> StrictInstance:
    """``inst`` whose offline streams are ``offline`` (request id, context tokens)."""
    from dataclasses import replace

    return replace(inst, num_offline=len(offline), offline=tuple(offline), **kw)


def test_a_strict_instance_that_holds_its_slo_keeps_its_offline_decodes():
    policy = ColocationPolicy(tpot_slo_s=0.05, headroom=0.8)
    inst = with_offline(strict("d0", 2, 0, 3000), [("o1", 500), ("o2", 500)])
    assert policy.select_evictions([inst]) == []
    # observed within the SLO too
    assert policy.select_evictions([with_offline(inst, list(inst.offline), observed_step_s=0.03)]) == []


def test_rising_online_load_evicts_offline_decodes_largest_context_first_until_under_headroom():
    policy = ColocationPolicy(tpot_slo_s=0.05, headroom=0.8)
    m = fitted()
    offline = [("small", 500), ("big", 30_000), ("mid", 10_000), ("tiny", 100)]
    # online load rose: 4 streams over 8k tokens of context, plus the offline ones
    inst = with_offline(strict("d0", 4, 0, 8000 + 40_600, model=m), offline)
    assert m.predict(8, 48_600) > 0.05
    evictions = policy.select_evictions([inst])
    order = [e.req_id for e in evictions]
    assert order[0] == "big" and all(e.instance == "d0" for e in evictions)
    assert "predicted step" in evictions[0].reason and "SLO 50.0 ms" in evictions[0].reason
    # the fewest that bring the predicted step back under headroom x SLO
    left = [o for o in offline if o[0] not in order]
    assert order == ["big", "mid"] and m.predict(4 + len(left), 8000 + sum(c for _, c in left)) <= 0.04
    assert m.predict(4 + len(left) + 1, 8000 + sum(c for _, c in left) + 10_000) > 0.04  # "mid" had to go


def test_an_online_stream_with_a_tighter_slo_evicts_and_blocks_offline_decodes():
    policy = ColocationPolicy(tpot_slo_s=0.05, headroom=0.8)
    m = fitted(overhead_s=0.004)
    base = strict("d0", 2, 0, 3000, model=m)
    tight = with_offline(base, [("o1", 500)], tpot_slo_s=0.004)  # an online stream asked for 4 ms
    assert policy.slo_of(tight) == 0.004
    [ev] = policy.select_evictions([tight])
    assert ev.req_id == "o1" and "SLO 4.0 ms" in ev.reason
    # and no new offline decode joins it
    assert not policy.select_offline_decode("p0", 300, [with_offline(base, [], tpot_slo_s=0.004)]).strict


def test_observed_miss_evicts_one_per_check_and_blocks_admission():
    policy = ColocationPolicy(tpot_slo_s=0.05, headroom=0.8)
    inst = with_offline(strict("d0", 2, 0, 3000), [("o1", 500), ("o2", 800)], observed_step_s=0.07)
    [ev] = policy.select_evictions([inst])  # the model says fine: one leaves, the next check sees
    assert ev.req_id == "o2" and "observed 70.0 ms" in ev.reason
    slow = with_offline(strict("d0", 2, 0, 3000), [], observed_step_s=0.045)  # over 0.8 x 50 ms
    assert not policy.select_offline_decode("p0", 300, [slow]).strict
