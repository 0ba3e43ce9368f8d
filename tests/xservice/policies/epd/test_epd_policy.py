"""EPD profiler policy: fits, Algorithm 1's budgets by binary search, strategy choice over hand-built costs."""

from __future__ import annotations

import dataclasses
import math

import pytest

from benchmarks.cluster_sim.epd import ILLUSTRATIVE, WORKLOADS
from xservice.policies.epd import (
    EPDSLO,
    STRATEGIES,
    EPDWorkload,
    budgets,
    choose_strategy,
    evaluate,
    fit_stage_costs,
    max_within,
    splits,
)
from xservice.policies.epd.model import cpu_demand

# a GPU-like instance (encode batching pays, decode steps are cheap per sequence) and two workloads: the
# cluster simulator's illustrative defaults, so its EPD deployments run what these tests reason about
COSTS = ILLUSTRATIVE
IMAGE_HEAVY, TEXT_HEAVY = WORKLOADS["image-heavy"], WORKLOADS["text-heavy"]
SLO = EPDSLO(ttft_s=2.0, tpot_s=0.05)


def test_fit_recovers_the_three_models_from_noiseless_samples() -> None:
    enc = [(p, COSTS.encode_batch_s(p)) for p in (1024, 2048, 4096, 8192)]
    pre = [(t, COSTS.prefill_alone_s(t)) for t in (64, 256, 1024, 4096)]
    dec = [(b, c, COSTS.decode_step_s(b, c)) for b in (1, 8, 32) for c in (512 * b, 2048 * b)]
    fitted = fit_stage_costs(enc, pre, dec)
    for name in (
        "encode_s",
        "encode_s_per_patch",
        "prefill_s",
        "prefill_s_per_token",
        "decode_s",
        "decode_s_per_seq",
    ):
        assert getattr(fitted, name) == pytest.approx(getattr(COSTS, name), rel=1e-3), name
    assert fitted.prefill_s_per_token2 == pytest.approx(COSTS.prefill_s_per_token2, rel=1e-2)
    assert fitted.decode_s_per_context_token == pytest.approx(COSTS.decode_s_per_context_token, rel=1e-2)
    # and predicts the stage times at points no sample was taken at
    assert fitted.encode_batch_s(3000) == pytest.approx(COSTS.encode_batch_s(3000), rel=1e-3)
    assert fitted.prefill_alone_s(2000) == pytest.approx(COSTS.prefill_alone_s(2000), rel=1e-3)
    assert fitted.decode_step_s(16, 8192) == pytest.approx(COSTS.decode_step_s(16, 8192), rel=1e-3)
    with pytest.raises(ValueError, match="prefill: need samples at >= 3"):
        fit_stage_costs(enc, pre[:2], dec)


def test_max_within_is_exact_on_a_known_step_function_and_evaluates_each_point_once() -> None:
    calls: list[int] = []

    def step(x: int) -> float:  # 10 ms + 1 ms per unit: x <= 40 fits under 50 ms
        calls.append(x)
        return 0.010 + 0.001 * x

    assert max_within(step, 0.050, 1000) == 40
    assert len(calls) == len(set(calls)) and len(calls) <= 2 + math.ceil(math.log2(1000))
    assert max_within(step, 0.050, 30) == 30  # the whole range fits
    assert max_within(step, 0.050, 1000, granularity=16) == 32
    assert max_within(step, 0.005, 1000) == -1  # even x = 0 is over
    with pytest.raises(ValueError):
        max_within(step, 0.05, 10, granularity=0)


def test_budgets_exact_on_the_cost_model_and_monotone_in_the_slo() -> None:
    b = budgets(COSTS, 0.05, 8, context_tokens=8 * 1000, patches_per_image=1024)
    base = COSTS.decode_step_s(8, 8000)
    assert b.decode_only_s == pytest.approx(base)
    # τ_e: the largest k whose step fits, k + 1 does not
    k = b.max_encode_images
    assert (
        COSTS.step_s(8, 8000, encode_patches=k * 1024)
        <= 0.05
        < COSTS.step_s(8, 8000, encode_patches=(k + 1) * 1024)
    )
    chunk = b.max_prefill_chunk
    assert b.max_num_batched_tokens == 8 + chunk
    assert (
        COSTS.step_s(8, 8000, prefill_tokens=chunk) <= 0.05 < COSTS.step_s(8, 8000, prefill_tokens=chunk + 1)
    )
    previous = (0, 0)
    for slo_ms in (20, 30, 40, 60, 100, 200, 400):
        got = budgets(COSTS, slo_ms / 1e3, 8, context_tokens=8000, patches_per_image=1024)
        assert got.max_encode_images >= previous[0] and got.max_num_batched_tokens >= previous[1]
        previous = (got.max_encode_images, got.max_num_batched_tokens)
    assert previous[0] > 0 and previous[1] > 8


def test_budgets_search_measured_step_functions_and_report_infeasible_decodes() -> None:
    measured = {"encode": [], "prefill": []}

    def encode_step(k: int) -> float:
        measured["encode"].append(k)
        return 0.020 + 0.007 * k  # 4 images fit in 50 ms

    def prefill_step(t: int) -> float:
        measured["prefill"].append(t)
        return 0.020 + 0.0001 * t  # 300 tokens fit

    b = budgets(None, 0.05, 4, encode_step=encode_step, prefill_step=prefill_step, max_tokens=4096)
    assert (b.max_encode_images, b.max_num_batched_tokens) == (4, 304)
    assert {kind for kind, *_ in b.probes} == {"encode", "prefill"}
    # the decode-only step (x = 0) is measured once, by the token search, and shared with the image search
    assert measured["prefill"].count(0) == 1 and 0 not in measured["encode"]
    assert len(b.probes) == len(measured["encode"]) + len(measured["prefill"]) + 1
    assert ("encode", 0, 0.020) in b.probes
    none = budgets(COSTS, 0.01, 64, context_tokens=64 * 1000)  # the decodes alone take > 10 ms
    assert not none.feasible and (none.max_encode_images, none.max_num_batched_tokens) == (0, 0)
    with pytest.raises(ValueError, match="needs costs"):
        budgets(None, 0.05, 4)


@pytest.mark.parametrize("n", [3, 4, 5, 7])
def test_every_split_sums_to_n_with_at_least_one_per_pool(n: int) -> None:
    for pools in (1, 2, 3):
        got = list(splits(n, pools))
        assert len(got) == math.comb(n - 1, pools - 1)  # compositions of n into `pools` parts
        assert all(sum(s) == n and min(s) >= 1 and len(s) == pools for s in got)
    choice = choose_strategy(COSTS, IMAGE_HEAVY, n, SLO)
    assert len(choice.table) == sum(math.comb(n - 1, len(p) - 1) for p in STRATEGIES.values())
    for row in choice.table:
        counts = dict(row.counts)
        assert tuple(counts) == STRATEGIES[row.strategy]
        assert sum(counts.values()) == n and min(counts.values()) >= 1
    assert [r.goodput for r in choice.table] == sorted((r.goodput for r in choice.table), reverse=True)
    assert choice.best == choice.table[0]


@pytest.mark.parametrize("n", [4, 6])
def test_image_heavy_short_outputs_separate_the_encoder(n: int) -> None:
    # (with 3 instances the single E instance would be the bottleneck: EP+D with 2 EP wins there)
    choice = choose_strategy(COSTS, IMAGE_HEAVY, n, SLO)
    assert choice.best.strategy in ("E+P+D", "ED+P")
    best_of = {}
    for row in choice.table:
        best_of.setdefault(row.strategy, row)
    assert best_of["E+P+D"].goodput > best_of["EP+D"].goodput > 0
    # the colocated baseline: every decode step with an image encode is over the TPOT SLO
    assert best_of["EPD"].goodput < choice.best.goodput
    assert "encode" in best_of["EPD"].limit


@pytest.mark.parametrize("n", [3, 4])
def test_text_heavy_long_outputs_keep_the_encoder_with_prefill(n: int) -> None:
    choice = choose_strategy(COSTS, TEXT_HEAVY, n, SLO)
    assert choice.best.strategy == "EP+D"
    best_of = {}
    for row in choice.table:
        best_of.setdefault(row.strategy, row)
    # encodes in ED's decode steps cost TPOT; a pool of E alone takes an instance from decoding
    assert best_of["ED+P"].goodput < choice.best.goodput
    assert best_of["E+P+D"].goodput <= choice.best.goodput


def test_infeasible_slos_give_zero_goodput_with_a_reason() -> None:
    tight_tpot = choose_strategy(COSTS, TEXT_HEAVY, 4, EPDSLO(ttft_s=2.0, tpot_s=0.010))  # d0 = 15 ms
    assert all(r.goodput == 0 for r in tight_tpot.table)
    assert all(r.limit.startswith("infeasible: TPOT") for r in tight_tpot.table)
    tight_ttft = choose_strategy(COSTS, IMAGE_HEAVY, 4, EPDSLO(ttft_s=0.01, tpot_s=0.05))
    assert all(r.goodput == 0 and r.limit.startswith("infeasible:") for r in tight_ttft.table)
    assert any("TTFT" in r.limit for r in tight_ttft.table)


def test_offered_rate_caps_goodput_and_a_higher_rate_is_limited() -> None:
    choice = choose_strategy(COSTS, dataclasses.replace(IMAGE_HEAVY, request_rate=1.0), 4, SLO)
    assert choice.best.goodput == 1.0 and choice.best.limit == "meets the SLOs at the offered rate"
    unbounded = choose_strategy(COSTS, IMAGE_HEAVY, 4, SLO).best
    e = evaluate(
        unbounded.strategy,
        tuple(c for _, c in unbounded.counts),
        COSTS,
        IMAGE_HEAVY,
        SLO,
        unbounded.goodput * 1.05,
    )
    assert not e.ok and e.limit
    ok = evaluate(
        unbounded.strategy, tuple(c for _, c in unbounded.counts), COSTS, IMAGE_HEAVY, SLO, unbounded.goodput
    )
    assert ok.ok and ok.ttft_s <= SLO.ttft_s and ok.tpot_s <= SLO.tpot_s


def test_bad_inputs_are_value_errors_naming_the_field() -> None:
    with pytest.raises(ValueError, match="output_tokens"):
        EPDWorkload(1, 64, 256, 10, 0)
    with pytest.raises(ValueError, match="request_rate"):
        EPDWorkload(1, 64, 256, 10, 10, request_rate=0)
    with pytest.raises(ValueError, match="decode_s"):
        dataclasses.replace(COSTS, decode_s=-1.0)
    with pytest.raises(ValueError, match="SLOs"):
        EPDSLO(0, 0.05)
    with pytest.raises(ValueError, match="unknown strategies"):
        choose_strategy(COSTS, IMAGE_HEAVY, 4, SLO, strategies=("E+D",))
    only = choose_strategy(COSTS, IMAGE_HEAVY, 1, SLO)  # one instance: only the colocated baseline
    assert [r.strategy for r in only.table] == ["EPD"]


def test_shared_cores_slow_down_busy_instances_and_never_raise_goodput() -> None:
    alone = choose_strategy(COSTS, TEXT_HEAVY, 3, SLO)
    # one core per instance is what the model assumes without cores: identical table
    assert choose_strategy(COSTS, TEXT_HEAVY, 3, SLO, cores=3).table == alone.table
    shared = choose_strategy(COSTS, TEXT_HEAVY, 3, SLO, cores=1)
    independent = {(r.strategy, r.counts): r.goodput for r in alone.table}
    assert all(r.goodput <= independent[(r.strategy, r.counts)] for r in shared.table)
    assert shared.best.goodput < alone.best.goodput
    counts = tuple(c for _, c in alone.best.counts)
    rate = alone.best.goodput / 2
    free = evaluate(alone.best.strategy, counts, COSTS, TEXT_HEAVY, SLO, rate)
    busy = evaluate(alone.best.strategy, counts, COSTS, TEXT_HEAVY, SLO, rate, cores=1)
    assert free.slowdown == 1.0 and busy.slowdown > 1.0
    assert busy.tpot_s > free.tpot_s and busy.ttft_s > free.ttft_s
    demand = [cpu_demand("EPD", (3,), COSTS, TEXT_HEAVY, r) for r in (0.5, 1.0, 2.0, 1e6)]
    assert demand == sorted(demand) and demand[-1] == 3.0  # at most one core per instance
    with pytest.raises(ValueError, match="cores"):
        evaluate("EPD", (3,), COSTS, TEXT_HEAVY, SLO, 1.0, cores=0)
