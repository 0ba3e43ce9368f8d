"""Dynamic PD's early D→P flips (a prefill backlog), placement headroom, and flips in batches at scale."""

from __future__ import annotations

import math

import pytest

from tests.xservice.policies.test_dynamic_pd_policy import NOW, SLO_, inst, tpot_model, uncached
from xservice.policies.dynamic_pd import DECODE, PREFILL, DynamicPDPolicy, FlipHistory, steady_step


def backlogged(queue_s: float, decode: int = 4, **decode_kw) -> list:
    return [inst(f"p{i}", PREFILL, PREFILL, queue_s=queue_s, num_prefilling=3) for i in range(2)] + [
        inst(f"d{i}", DECODE, DECODE, decode_tokens=100 * (i + 1), num_decoding=1, **decode_kw)
        for i in range(decode)
    ]


def test_a_prefill_backlog_flips_the_lightest_decode_instance_before_the_slo_is_missed() -> None:
    policy = DynamicPDPolicy(min_decode=2, backlog=0.3)
    # 0.2 s queued on each prefill instance: 40% of the 0.5 s TTFT SLO, every arrival still meets it
    flips = policy.plan_flips(SLO_, backlogged(0.2), FlipHistory(), NOW)
    assert [(f.name, f.to_role) for f in flips] == [("d0", PREFILL)]
    assert "queued" in flips[0].reason
    assert policy.plan_flips(SLO_, backlogged(0.1), FlipHistory(), NOW) == []  # under 30% of the SLO


def test_a_lent_instance_goes_home_first() -> None:
    policy = DynamicPDPolicy(min_decode=2)
    instances = backlogged(0.3) + [inst("p9", PREFILL, DECODE, decode_tokens=5000, num_decoding=9)]
    assert [f.name for f in policy.plan_flips(SLO_, instances, FlipHistory(), NOW)] == ["p9"]


def test_no_backlog_flip_while_decode_is_pressed_or_would_fall_below_its_minimum() -> None:
    policy = DynamicPDPolicy(min_decode=2)
    # a decode batch at 90% of the TPOT SLO, made by its load: decode cannot spare one
    pressed = backlogged(0.3, observed_step_s=0.045, tpot=tpot_model(0.005, 0.001))
    assert policy.plan_flips(SLO_, pressed, FlipHistory(), NOW) == []
    missing = backlogged(0.3, observed_step_s=0.08, busy_since=NOW - 5)
    assert all(f.to_role == DECODE for f in policy.plan_flips(SLO_, missing, FlipHistory(), NOW))
    assert policy.plan_flips(SLO_, backlogged(0.3, decode=2), FlipHistory(), NOW) == []


def test_no_backlog_flip_when_the_rest_of_decode_cannot_hold_its_kv() -> None:
    policy = DynamicPDPolicy(min_decode=2, capacity_pressure=0.9)
    full = backlogged(0.3, reserved_tokens=800, capacity_tokens=1000)  # 80% committed over four
    assert policy.plan_flips(SLO_, full, FlipHistory(), NOW) == []
    roomy = backlogged(0.3, reserved_tokens=500, capacity_tokens=1000)
    assert len(policy.plan_flips(SLO_, roomy, FlipHistory(), NOW)) == 1


def test_a_large_cluster_flips_a_share_of_its_instances_at_once() -> None:
    policy = DynamicPDPolicy(min_decode=2, flip_share=0.05)
    instances = [inst(f"p{i}", PREFILL, PREFILL, queue_s=0.4, num_prefilling=2) for i in range(40)] + [
        inst(f"d{i}", DECODE, DECODE, decode_tokens=10 * i, num_decoding=1) for i in range(60)
    ]
    flips = policy.plan_flips(SLO_, instances, FlipHistory(), NOW)
    assert [f.name for f in flips] == [f"d{i}" for i in range(5)]  # 5% of 100, lightest first
    assert policy.max_flips(8) == 1
    # idle prefill instances while decode is pressed: a batch of them the other way
    idle = [inst(f"p{i}", PREFILL, PREFILL, prefill_utilization=0.0) for i in range(40)]
    pressed = [
        inst(f"d{i}", DECODE, DECODE, num_decoding=8, decode_tokens=800, observed_step_s=0.045)
        for i in range(60)
    ]
    flips = policy.plan_flips(SLO_, idle + pressed, FlipHistory(), NOW)
    assert len(flips) == 5 and {f.to_role for f in flips} == {DECODE}


def test_a_prompt_leaves_a_queued_pool_for_the_prefill_sides_fastest() -> None:
    """The P pool's least-queued instance predicts 0.4 s (within the 0.5 s SLO, past the 30% headroom):
    a lent D→P instance with an empty queue takes the prompt."""
    policy = DynamicPDPolicy(headroom=0.3)
    instances = [
        inst("p0", PREFILL, PREFILL, queue_s=0.3),
        inst("d0", DECODE, PREFILL, queue_s=0.0),
        inst("d1", DECODE, DECODE),
        inst("d2", DECODE, DECODE),
    ]
    choice = policy.select_prefill(uncached(100, "p0", "d0"), SLO_, instances, FlipHistory(), NOW)
    assert choice.name == "d0" and choice.flip is None
    # with headroom 1.0 (the old rule: anything within the SLO) the P pool keeps it
    keep = DynamicPDPolicy(headroom=1.0).select_prefill(
        uncached(100, "p0", "d0"), SLO_, instances, FlipHistory(), NOW
    )
    assert keep.name == "p0"


def test_the_decode_side_left_must_serve_its_token_rate() -> None:
    """Step = 10 ms + 2 ms per sequence. Two instances of 10 sequences at 30 ms make 667 tokens/s;
    spread over ``left`` instances the step settles where batch = rate x step."""
    two = [
        inst(f"d{i}", DECODE, DECODE, num_decoding=10, decode_tokens=1000, observed_step_s=0.03)
        for i in range(2)
    ]
    assert steady_step(two, 2) == pytest.approx(0.03, rel=0.05)
    assert steady_step(two, 3) == pytest.approx(0.01 / (1 - 0.002 * 667 / 3), rel=0.05)
    assert steady_step(two, 1) == math.inf  # one instance cannot make 667 tokens/s at any batch
    assert steady_step([inst("d0", DECODE, DECODE)], 1) == 0.0  # nothing decoding


def decoding(batch: int, slower: float = 1.0) -> list:
    """Three decode instances of ``batch`` sequences each, their streams seeing the predicted step
    (10 ms + 2 ms per sequence) times ``slower``."""
    return [
        inst(
            f"d{i}",
            DECODE,
            DECODE,
            num_decoding=batch,
            decode_tokens=100 * batch,
            observed_step_s=slower * (0.01 + 0.002 * batch),
        )
        for i in range(3)
    ]


def test_no_backlog_flip_when_the_rest_of_decode_would_slow_past_the_pressure_mark() -> None:
    """Three decode instances under the 40 ms pressure mark of the 50 ms TPOT SLO: with 4 sequences each
    (18 ms) two can take their tokens (30 ms); with 8 each (26 ms) two settle far past it."""
    policy = DynamicPDPolicy(min_decode=1)
    queued = [inst(f"p{i}", PREFILL, PREFILL, queue_s=0.3, num_prefilling=2) for i in range(2)]
    assert steady_step(decoding(4), 2) == pytest.approx(0.03, rel=0.05)
    assert len(policy.plan_flips(SLO_, queued + decoding(4), FlipHistory(), NOW)) == 1
    assert policy.plan_flips(SLO_, queued + decoding(8), FlipHistory(), NOW) == []


def test_streams_slower_than_the_model_count_against_a_flip() -> None:
    """The streams see 1.5x the predicted step (KV imports, a busy host): the decode instances left are
    priced at that, and four sequences each no longer spare one."""
    policy = DynamicPDPolicy(min_decode=1)
    queued = [inst(f"p{i}", PREFILL, PREFILL, queue_s=0.3, num_prefilling=2) for i in range(2)]
    assert steady_step(decoding(4, slower=1.5), 3) == pytest.approx(1.5 * 0.018, rel=0.05)
    assert steady_step(decoding(4, slower=1.5), 2) > 0.04
    assert policy.plan_flips(SLO_, queued + decoding(4, slower=1.5), FlipHistory(), NOW) == []


def test_a_ttft_miss_takes_no_instance_the_decode_side_cannot_spare() -> None:
    """A prompt predicted to miss the TTFT SLO flips a decode instance only if the decode instances left
    can take its streams' tokens (the same ``steady_step`` test as a backlog flip)."""
    policy = DynamicPDPolicy(min_decode=1)

    def cluster(batch: int) -> list:
        return [inst("p0", PREFILL, PREFILL, queue_s=2.0)] + decoding(batch)

    names = ("p0", "d0", "d1", "d2")
    assert policy.select_prefill(uncached(100, *names), SLO_, cluster(4), FlipHistory(), NOW).flip is not None
    pressed = policy.select_prefill(uncached(100, *names), SLO_, cluster(8), FlipHistory(), NOW)
    assert pressed.flip is None and pressed.name == "p0" and not pressed.meets_slo
