"""Dynamic PD's pure policy (xservice/policies/dynamic_pd.py) over hand-built snapshots."""

from __future__ import annotations

import pytest

from xservice.policies.dynamic_pd import (
    DECODE,
    POOL_D,
    POOL_D2P,
    POOL_P,
    POOL_P2D,
    PREFILL,
    SLO,
    DynamicPDPolicy,
    Flip,
    FlipHistory,
    PDInstance,
    pool_of,
)
from xservice.policies.predictors import TPOTPredictor, TTFTPredictor

SLO_ = SLO(ttft_s=0.5, tpot_s=0.05)
NOW = 1000.0


def ttft_model(per_token_s: float = 1e-3) -> TTFTPredictor:
    """Prefill compute = per_token_s * L (exact, from seeds)."""
    t = TTFTPredictor()
    for n in (16, 128, 512, 1024):
        t.observe(n, per_token_s * n, seed=True)
    return t


def tpot_model(base_s: float = 0.01, per_seq_s: float = 0.002) -> TPOTPredictor:
    """Step time = base + per_seq * B (context tokens free)."""
    t = TPOTPredictor()
    for b in (1, 2, 4, 8, 16):
        t.observe(b, b * 100, base_s + per_seq_s * b, seed=True)
    return t


def inst(name: str, origin: str, role: str, **kw) -> PDInstance:
    kw.setdefault("ttft", ttft_model())
    kw.setdefault("tpot", tpot_model())
    return PDInstance(name=name, origin=origin, role=role, **kw)


def uncached(n: int, *names: str) -> dict[str, int]:
    return dict.fromkeys(names, n)


def test_pools_from_origin_and_role() -> None:
    assert pool_of(PREFILL, PREFILL) == POOL_P
    assert pool_of(DECODE, DECODE) == POOL_D
    assert pool_of(PREFILL, DECODE) == POOL_P2D
    assert pool_of(DECODE, PREFILL) == POOL_D2P


def test_prefill_goes_to_least_queued_p_instance_meeting_slo() -> None:
    policy = DynamicPDPolicy()
    instances = [
        inst("p0", PREFILL, PREFILL, queue_s=0.3),
        inst("p1", PREFILL, PREFILL, queue_s=0.1),
        inst("d0", DECODE, DECODE),
        inst("d1", DECODE, DECODE),
    ]
    choice = policy.select_prefill(uncached(100, "p0", "p1", "d0", "d1"), SLO_, instances, FlipHistory(), NOW)
    assert choice.name == "p1" and choice.flip is None and choice.meets_slo
    assert choice.predicted_ttft_s == pytest.approx(0.1 + 0.1, rel=1e-3)


def test_prefill_uses_the_uncached_tokens_of_each_instance() -> None:
    """A prefix-cache hit shortens the predicted compute: the SLO holds there and not elsewhere."""
    policy = DynamicPDPolicy()
    instances = [
        inst("p0", PREFILL, PREFILL, queue_s=0.0),
        inst("d0", DECODE, DECODE),
        inst("d1", DECODE, DECODE),
    ]
    miss = policy.select_prefill({"p0": 800}, SLO_, instances, FlipHistory(), NOW)
    assert not miss.meets_slo or miss.flip is not None
    hit = policy.select_prefill({"p0": 100}, SLO_, instances, FlipHistory(), NOW)
    assert hit.name == "p0" and hit.meets_slo and hit.flip is None


def test_no_flip_while_some_prefill_instance_meets_the_slo() -> None:
    """The least-queued P instance misses (no cache hit there) but another one holds the prompt's prefix."""
    policy = DynamicPDPolicy(min_decode=1)
    instances = [
        inst("p0", PREFILL, PREFILL, queue_s=0.0),
        inst("p1", PREFILL, PREFILL, queue_s=0.2),
        inst("d0", DECODE, DECODE),
        inst("d1", DECODE, DECODE),
    ]
    choice = policy.select_prefill(
        {"p0": 900, "p1": 100, "d0": 900, "d1": 900}, SLO_, instances, FlipHistory(), NOW
    )
    assert choice.name == "p1" and choice.flip is None and choice.meets_slo


def test_prefill_falls_back_to_d2p_pool_before_flipping() -> None:
    policy = DynamicPDPolicy()
    instances = [
        inst("p0", PREFILL, PREFILL, queue_s=0.6),
        inst("d0", DECODE, PREFILL, queue_s=0.05),  # D→P
        inst("d1", DECODE, DECODE),
        inst("d2", DECODE, DECODE),
    ]
    choice = policy.select_prefill(uncached(100, "p0", "d0"), SLO_, instances, FlipHistory(), NOW)
    assert choice.name == "d0" and choice.flip is None


def test_ttft_miss_flips_lightest_decode_instance_preferring_p2d() -> None:
    policy = DynamicPDPolicy(min_decode=2)
    instances = [
        inst("p0", PREFILL, PREFILL, queue_s=2.0),
        inst("d0", DECODE, DECODE, decode_tokens=10, num_decoding=1),
        inst("p1", PREFILL, DECODE, decode_tokens=500, num_decoding=4),  # P→D: goes home first
        inst("d1", DECODE, DECODE, decode_tokens=5, num_decoding=1),
    ]
    choice = policy.select_prefill(uncached(100, "p0", "d0", "d1", "p1"), SLO_, instances, FlipHistory(), NOW)
    assert choice.flip == Flip("p1", PREFILL, choice.flip.reason) and choice.name == "p1"
    assert "SLO" in choice.flip.reason
    # without a P→D instance: the decode instance with the fewest running tokens
    instances = [i for i in instances if i.name != "p1"] + [inst("d2", DECODE, DECODE, decode_tokens=50)]
    choice = policy.select_prefill(uncached(100, "p0", "d0", "d1", "d2"), SLO_, instances, FlipHistory(), NOW)
    assert choice.flip is not None and choice.name == "d1"


def test_never_fewer_than_min_decode() -> None:
    policy = DynamicPDPolicy(min_decode=2)
    instances = [
        inst("p0", PREFILL, PREFILL, queue_s=2.0),
        inst("d0", DECODE, DECODE),
        inst("d1", DECODE, DECODE),
    ]
    choice = policy.select_prefill(uncached(100, "p0", "d0", "d1"), SLO_, instances, FlipHistory(), NOW)
    assert choice.flip is None and choice.name == "p0" and not choice.meets_slo
    assert (
        DynamicPDPolicy(min_decode=1)
        .select_prefill(uncached(100, "p0", "d0", "d1"), SLO_, instances, FlipHistory(), NOW)
        .flip
        is not None
    )


def test_no_flip_when_it_would_not_help() -> None:
    """A flipped instance must predict a lower TTFT than the best prefill instance (its own queue)."""
    policy = DynamicPDPolicy(min_decode=1)
    instances = [
        inst("p0", PREFILL, PREFILL, queue_s=0.6),
        inst("d0", DECODE, DECODE, queue_s=0.9),
        inst("d1", DECODE, DECODE, queue_s=0.9),
    ]
    choice = policy.select_prefill(uncached(100, "p0", "d0", "d1"), SLO_, instances, FlipHistory(), NOW)
    assert choice.flip is None and choice.name == "p0"


def test_flip_cooldown_and_opposite_direction_hysteresis() -> None:
    policy = DynamicPDPolicy(min_decode=1, cooldown_s=5.0, min_interval_s=1.0)
    recent = inst("d0", DECODE, DECODE, last_flip_at=NOW - 2.0)
    assert not policy.may_flip(recent, PREFILL, FlipHistory(), NOW)
    assert policy.may_flip(recent, PREFILL, FlipHistory(), NOW + 3.5)
    history = FlipHistory()
    history.record(Flip("x", PREFILL, "r"), NOW - 0.5)
    fresh = inst("d1", DECODE, DECODE)
    assert not policy.may_flip(fresh, PREFILL, history, NOW)  # min interval cluster-wide
    assert policy.may_flip(fresh, PREFILL, history, NOW + 1.0)  # same direction: after the interval
    p = inst("p0", PREFILL, PREFILL)
    assert not policy.may_flip(p, DECODE, history, NOW + 1.0)  # the other way: after the cooldown
    assert policy.may_flip(p, DECODE, history, NOW + 4.6)
    assert not policy.may_flip(p, PREFILL, FlipHistory(), NOW)  # already there


def test_alternating_pressure_does_not_oscillate() -> None:
    """TTFT and TPOT pressure alternating every 0.5 s: at most one flip per cooldown window."""
    policy = DynamicPDPolicy(min_decode=1, cooldown_s=5.0, min_interval_s=1.0, sustain_s=0.0)
    roles = {"a": PREFILL, "b": DECODE, "c": DECODE}
    origin = dict(roles)
    flipped: dict[str, float] = {}
    history = FlipHistory()
    times = []
    for step in range(40):
        now = NOW + 0.5 * step
        ttft_pressure = step % 2 == 0
        instances = [
            inst(
                n,
                origin[n],
                roles[n],
                queue_s=2.0 if ttft_pressure and roles[n] == PREFILL else 0.0,
                # light decode under TTFT pressure (it can spare an instance), heavy under TPOT pressure
                num_decoding=(1 if ttft_pressure else 4) if roles[n] == DECODE else 0,
                observed_step_s=0.2 if not ttft_pressure and roles[n] == DECODE else 0.01,
                busy_since=now if not ttft_pressure and roles[n] == DECODE else None,
                last_flip_at=flipped.get(n),
            )
            for n in roles
        ]
        flips = []
        if ttft_pressure:
            choice = policy.select_prefill(uncached(100, *roles), SLO_, instances, history, now)
            flips = [choice.flip] if choice.flip else []
        else:
            flips = policy.plan_flips(SLO_, instances, history, now)
        for f in flips:
            roles[f.name] = f.to_role
            flipped[f.name] = now
            history.record(f, now)
            times.append(now)
    assert times, "pressure should flip at least once"
    assert all(b - a >= 5.0 for a, b in zip(times, times[1:])), times


def test_decode_prefers_prefill_instance_when_it_holds_tpot() -> None:
    policy = DynamicPDPolicy()
    instances = [
        inst("p0", PREFILL, PREFILL, num_decoding=2, decode_tokens=200),
        inst("d0", DECODE, DECODE),
        inst("d1", DECODE, DECODE),
    ]
    choice = policy.select_decode("p0", 100, SLO_, instances)
    assert choice.name == "p0" and "no KV transfer" in choice.reason
    # prefills queued behind it: decoding there would stall them -> a decode instance
    busy = [inst("p0", PREFILL, PREFILL, num_prefilling=1)] + instances[1:]
    assert policy.select_decode("p0", 100, SLO_, busy).name in ("d0", "d1")
    # its batch would miss the TPOT SLO (0.01 + 0.002 * 21 > 0.05)
    full = [inst("p0", PREFILL, PREFILL, num_decoding=20, decode_tokens=2000)] + instances[1:]
    assert policy.select_decode("p0", 100, SLO_, full).name in ("d0", "d1")


def test_prefill_instance_observed_over_the_tpot_slo_keeps_no_more_decodes() -> None:
    """The model predicts the step under the SLO, but the streams already decoding there see it over:
    what is observed wins (a noisy fit must not pile streams onto a prefill instance)."""
    policy = DynamicPDPolicy()
    ok = inst("p0", PREFILL, PREFILL, num_decoding=2, decode_tokens=200, observed_step_s=0.03)
    over = inst("p0", PREFILL, PREFILL, num_decoding=2, decode_tokens=200, observed_step_s=0.09)
    d0 = inst("d0", DECODE, DECODE)
    assert policy.select_decode("p0", 100, SLO_, [ok, d0]).name == "p0"
    assert policy.select_decode("p0", 100, SLO_, [over, d0]).name == "d0"


def test_prefill_instance_keeps_a_decode_only_if_its_prefills_leave_the_tpot_slo() -> None:
    """The prefill instance goes on prefilling: its decode steps are predicted with a prompt like
    this request's riding along (the TPOT model's prefill-token term)."""
    t = TPOTPredictor()
    for b, p in ((1, 0), (4, 0), (8, 0), (1, 200), (4, 400), (2, 800)):
        t.observe(b, b * 100, 0.01 + 0.002 * b + 0.0001 * p, prefill_tokens=p, seed=True)
    policy = DynamicPDPolicy()
    instances = [inst("p0", PREFILL, PREFILL, tpot=t), inst("d0", DECODE, DECODE)]
    short = policy.select_decode("p0", 30, SLO_, instances)  # 0.01 + 0.002 + 0.003 <= 0.05
    assert short.name == "p0" and "no KV transfer" in short.reason
    long = policy.select_decode("p0", 600, SLO_, instances)  # 0.01 + 0.002 + 0.06 > 0.05
    assert long.name == "d0"


def test_decode_picks_fewest_running_tokens_within_capacity_and_slo() -> None:
    policy = DynamicPDPolicy()
    instances = [
        inst("p0", PREFILL, PREFILL, num_prefilling=3),
        inst("d0", DECODE, DECODE, num_decoding=3, decode_tokens=300),
        inst("d1", DECODE, DECODE, num_decoding=1, decode_tokens=100, capacity_tokens=150),
        inst("d2", DECODE, DECODE, num_decoding=2, decode_tokens=200),
    ]
    choice = policy.select_decode("p0", 100, SLO_, instances)
    assert choice.name == "d2"  # d1 has fewer tokens but the request would overflow its KV capacity
    # every decode instance predicted over the SLO: still the fewest running tokens
    slow = [inst(i.name, i.origin, i.role, num_decoding=i.num_decoding, decode_tokens=i.decode_tokens,
                 num_prefilling=i.num_prefilling, tpot=tpot_model(base_s=0.2)) for i in instances]  # fmt: skip
    choice = policy.select_decode("p0", 100, SLO_, slow)
    assert choice.name == "d1" and "not predicted" in choice.reason


def test_tpot_miss_flips_a_prefill_instance_preferring_d2p() -> None:
    policy = DynamicPDPolicy(min_prefill=1, sustain_s=1.0)
    instances = [
        inst("p0", PREFILL, PREFILL, prefill_utilization=0.9),
        inst("d0", DECODE, PREFILL, prefill_utilization=0.9),  # D→P: goes home first
        inst("d1", DECODE, DECODE, num_decoding=8, observed_step_s=0.09, busy_since=NOW - 2.0),
        inst("d2", DECODE, DECODE, num_decoding=8, observed_step_s=0.03),
    ]
    flips = policy.plan_flips(SLO_, instances, FlipHistory(), NOW)
    assert [(f.name, f.to_role) for f in flips] == [("d0", DECODE)]
    assert "TPOT" in flips[0].reason and "d1" in flips[0].reason
    # not sustained long enough yet
    young = instances[:2] + [
        inst("d1", DECODE, DECODE, num_decoding=8, observed_step_s=0.09, busy_since=NOW - 0.5)
    ]
    assert policy.plan_flips(SLO_, young, FlipHistory(), NOW) == []


def test_idle_prefill_flips_to_decode_only_while_decode_is_busy() -> None:
    policy = DynamicPDPolicy(min_prefill=1, idle_utilization=0.2)
    base = [
        inst("p0", PREFILL, PREFILL, prefill_utilization=0.8),
        inst("p1", PREFILL, PREFILL, prefill_utilization=0.1),
    ]
    busy = base + [
        inst("d0", DECODE, DECODE, num_decoding=5, observed_step_s=0.045),  # 90% of the TPOT SLO
        inst("d1", DECODE, DECODE, num_decoding=5),
    ]
    flips = policy.plan_flips(SLO_, busy, FlipHistory(), NOW)
    assert [(f.name, f.to_role) for f in flips] == [("p1", DECODE)]
    assert "busy 10%" in flips[0].reason
    quiet = base + [inst("d0", DECODE, DECODE), inst("d1", DECODE, DECODE)]
    assert policy.plan_flips(SLO_, quiet, FlipHistory(), NOW) == []
    coping = base + [inst("d0", DECODE, DECODE, num_decoding=5, observed_step_s=0.03)]  # 60% of the SLO
    assert policy.plan_flips(SLO_, coping, FlipHistory(), NOW) == []


def test_a_decode_step_slow_by_its_device_is_no_reason_to_flip_an_idle_prefill() -> None:
    """A device whose lone decode step is near the SLO: a batch at 90% of it is no pressure more decode
    instances would relieve; the same step time with a lone-sequence floor of a third of it is."""
    policy = DynamicPDPolicy(min_prefill=1, idle_utilization=0.2)

    def tpot(step_s: float) -> TPOTPredictor:
        p = TPOTPredictor()
        for batch, ctx in ((1, 100), (2, 200), (4, 400), (8, 800), (16, 1600)):
            p.observe(batch, ctx, step_s, seed=True)  # flat: the device's floor, whatever the batch
        return p

    base = [
        inst("p0", PREFILL, PREFILL, prefill_utilization=0.8),
        inst("p1", PREFILL, PREFILL, prefill_utilization=0.1),
        inst("d1", DECODE, DECODE),
    ]
    slow_device = inst(
        "d0", DECODE, DECODE, num_decoding=5, decode_tokens=500, observed_step_s=0.045, tpot=tpot(0.044)
    )
    assert policy.plan_flips(SLO_, base + [slow_device], FlipHistory(), NOW) == []
    loaded = inst(
        "d0", DECODE, DECODE, num_decoding=5, decode_tokens=500, observed_step_s=0.045, tpot=tpot(0.015)
    )
    assert [f.name for f in policy.plan_flips(SLO_, base + [loaded], FlipHistory(), NOW)] == ["p1"]


def test_never_fewer_than_min_prefill() -> None:
    policy = DynamicPDPolicy(min_prefill=1)
    instances = [
        inst("p0", PREFILL, PREFILL, prefill_utilization=0.0),
        inst("d0", DECODE, DECODE, num_decoding=9, observed_step_s=0.5, busy_since=NOW - 10),
    ]
    assert policy.plan_flips(SLO_, instances, FlipHistory(), NOW) == []


def test_invalid_minimums() -> None:
    with pytest.raises(ValueError):
        DynamicPDPolicy(min_decode=0)


def test_decode_capacity_counts_what_placed_streams_will_grow_to() -> None:
    policy = DynamicPDPolicy()
    instances = [
        inst("p0", PREFILL, PREFILL, num_prefilling=1),
        # d0 holds little KV today, but its young streams are promised 900 tokens
        inst(
            "d0", DECODE, DECODE, num_decoding=6, decode_tokens=200, reserved_tokens=900, capacity_tokens=1000
        ),
        inst(
            "d1", DECODE, DECODE, num_decoding=8, decode_tokens=400, reserved_tokens=500, capacity_tokens=1000
        ),
    ]
    assert instances[1].committed_tokens == 900 and instances[1].fits(100) and not instances[1].fits(101)
    # by context alone d0 is the lightest; the request may grow to 160 tokens, which d0 cannot hold
    choice = policy.select_decode("p0", 33, SLO_, instances, reserve_tokens=160)
    assert choice.name == "d1"
    # without a reservation (max_tokens unbounded) only its context counts
    assert policy.select_decode("p0", 33, SLO_, instances).name == "d0"


def test_full_decode_kv_flips_a_spare_prefill_instance() -> None:
    policy = DynamicPDPolicy(min_prefill=1, capacity_pressure=0.9)
    prefill = [
        inst("p0", PREFILL, PREFILL, num_prefilling=1, queue_s=0.05, prefill_utilization=0.4),
        inst("p1", PREFILL, PREFILL, prefill_utilization=0.2),  # nothing queued: spare
    ]
    full = [
        inst(
            "d0", DECODE, DECODE, num_decoding=9, decode_tokens=400, reserved_tokens=950, capacity_tokens=1000
        ),
        inst(
            "d1", DECODE, DECODE, num_decoding=9, decode_tokens=400, reserved_tokens=900, capacity_tokens=1000
        ),
    ]
    flips = policy.plan_flips(SLO_, prefill + full, FlipHistory(), NOW)
    assert [(f.name, f.to_role) for f in flips] == [("p1", DECODE)]
    assert "decode KV 92% committed" in flips[0].reason
    # room left on the decode side: no flip
    roomy = [inst("d0", DECODE, DECODE, reserved_tokens=500, capacity_tokens=1000), full[1]]
    assert policy.plan_flips(SLO_, prefill + roomy, FlipHistory(), NOW) == []
    # the other prefill instance's queue would miss the TTFT SLO without p1: keep it
    queued = [inst("p0", PREFILL, PREFILL, num_prefilling=4, queue_s=0.4), prefill[1]]
    assert policy.plan_flips(SLO_, queued + full, FlipHistory(), NOW) == []
    # the prefill side is too busy for one instance to carry it (60% + 50% > 70%)
    busy = [
        inst("p0", PREFILL, PREFILL, prefill_utilization=0.6),
        inst("p1", PREFILL, PREFILL, prefill_utilization=0.5),
    ]
    assert policy.plan_flips(SLO_, busy + full, FlipHistory(), NOW) == []
    # hysteresis still holds
    history = FlipHistory()
    history.record(Flip("d2", PREFILL, "ttft"), NOW - 1.0)
    assert policy.plan_flips(SLO_, prefill + full, history, NOW) == []
    # and never below min_prefill
    assert policy.plan_flips(SLO_, prefill[1:] + full, FlipHistory(), NOW) == []
