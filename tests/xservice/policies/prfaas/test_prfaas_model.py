"""The PrfaaS throughput model (``xservice/policies/prfaas/model.py``): equations 3-6 on hand-computable
inputs, the grid search's optimum, and the profile readers."""

from __future__ import annotations

import math

import pytest

from xservice.policies.prfaas import (
    DecodeRate,
    Deployment,
    EmpiricalLengths,
    LogNormalLengths,
    decode_rate,
    evaluate,
    plan,
    plan_homogeneous,
    plan_naive,
    prefill_curve,
)
from xservice.policies.prfaas.model import Stages

# linear prefill: 1 s per 1000 tokens locally, 4x faster on PrfaaS; 1 MB of KV per 1000 tokens
LOCAL = prefill_curve(
    {"name": "local", "prefill": {"tokens": [1000, 2000], "seconds": [1.0, 2.0], "kv_bytes": [1e6, 2e6]}}
)
FAST = prefill_curve(
    {"name": "fast", "prefill": {"tokens": [1000, 2000], "seconds": [0.25, 0.5], "kv_bytes": [1e6, 2e6]}}
)
LENGTHS = EmpiricalLengths((1000,) * 6 + (3000,) * 4)  # mean 1800; above 2000: 40% at 3000


def test_equations_3_to_6_by_hand() -> None:
    stages = Stages(local=LOCAL, decode=DecodeRate(10, 0.1), prfaas=FAST, bandwidth_gbps=1.0)
    pt = evaluate(Deployment(2, 3, 5, 2000), stages, LENGTHS, output_tokens=100)
    assert pt.p == pytest.approx(0.4) and pt.l_long == 3000 and pt.l_short == 1000
    # PrfaaS: compute 2 / 0.75 s = 2.67/s; link 1 Gbit/s / 24 Mbit = 41.7/s
    assert pt.theta_prfaas == pytest.approx(2 / 0.75)
    assert pt.ceiling_req_s == pytest.approx(1e9 / (3e6 * 8))
    assert pt.theta_pd_p == pytest.approx(3.0)  # 3 instances / 1 s
    assert pt.theta_pd_d == pytest.approx(5 * 10 / (0.1 * 100))  # 5 req/s
    assert pt.lambda_max == pytest.approx(min(2 / 0.75 / 0.4, 3.0 / 0.6, 5.0))
    assert pt.bottleneck == "pd-d"
    assert pt.egress_gbps == pytest.approx(pt.lambda_max * 0.4 * 3e6 * 8 / 1e9)


def test_a_narrow_link_binds_the_prfaas_stage() -> None:
    stages = Stages(local=LOCAL, decode=DecodeRate(100, 0.01), prfaas=FAST, bandwidth_gbps=0.024)
    pt = evaluate(Deployment(2, 3, 5, 2000), stages, LENGTHS, output_tokens=100)
    assert pt.theta_prfaas == pytest.approx(1.0)  # 24 Mbit/s over 24 Mbit a request
    assert pt.bottleneck == "prfaas-bandwidth"


def test_the_search_balances_the_stages() -> None:
    lengths = LogNormalLengths(math.log(1500), 0.8, 100, 20000)
    stages = Stages(local=LOCAL, decode=DecodeRate(20, 0.05), prfaas=FAST, bandwidth_gbps=100.0)
    best = plan(stages, lengths, 200, prfaas_instances=2, local_instances=8)
    d = best.deployment
    # no split or threshold nearby does better
    for n_p in range(1, 8):
        for t in (d.threshold * 0.7, d.threshold, d.threshold * 1.4):
            other = evaluate(Deployment(2, n_p, 8 - n_p, t), stages, lengths, 200)
            assert other.lambda_max <= best.lambda_max * (1 + 1e-6)
    # at the optimum the two prefill terms meet (equation 7) unless decode binds first
    pt = evaluate(d, stages, lengths, 200)
    assert pt.theta_prfaas / pt.p == pytest.approx(pt.theta_pd_p / (1 - pt.p), rel=1e-3)
    assert len(best.search["by_split_at_threshold"]) == 7
    homo = plan_homogeneous(stages, lengths, 200, 10)
    naive = plan_naive(stages, lengths, 200, 2, 8)
    assert best.lambda_max > homo.lambda_max and homo.deployment.prfaas == 0
    assert naive.p == 1.0 and naive.theta_pd_p is None and naive.deployment.prefill == 0
    assert best.to_dict()["threshold_tokens"] == round(d.threshold)
    assert homo.to_dict()["threshold_tokens"] is None and naive.to_dict()["threshold_tokens"] is None


def test_mean_service_times_price_a_convex_curve_higher() -> None:
    convex = prefill_curve(
        {"name": "c", "prefill": {"tokens": [1000, 10000], "seconds": [1.0, 30.0], "kv_bytes": [1e6, 1e7]}}
    )
    lengths = LogNormalLengths(math.log(2000), 1.0, 100, 20000)
    rep = Stages(local=convex, decode=DecodeRate(1000, 0.01), prfaas=convex)
    mean = Stages(local=convex, decode=DecodeRate(1000, 0.01), prfaas=convex, service="mean")
    a = plan_homogeneous(rep, lengths, 10, 4).lambda_max
    b = plan_homogeneous(mean, lengths, 10, 4).lambda_max
    assert b < a  # E[T(L)] > T(E[L]) (Jensen)
    with pytest.raises(ValueError, match="service"):
        Stages(local=convex, decode=DecodeRate(1, 1.0), service="typo")


def test_lognormal_conditionals_match_sampling() -> None:
    d = LogNormalLengths(9.9, 1.0, 128, 131072)
    assert d.mean() == pytest.approx(27486, rel=1e-3)  # the paper: "a mean of approximately 27K"
    s = d.split(19400)
    assert s.p == pytest.approx(0.496, abs=0.002)  # the paper: 49.6% offloaded at t = 19.4K
    emp = EmpiricalLengths(tuple(d.sample(20000, seed=1)))
    e = emp.split(19400)
    assert e.p == pytest.approx(s.p, abs=0.02) and e.l_long == pytest.approx(s.l_long, rel=0.03)
    assert d.expect(lambda x: x, 19400, True) == pytest.approx(s.l_long, rel=1e-3)


def test_profiles_of_both_shapes() -> None:
    device = {"name": "dev", "base_ms": 10.0, "tokens_ms": [[1, 0.0], [1000, 90.0]], "attention_ns": 1.0,
              "seq_us": 0.0, "kv_bytes_per_token": 1000, "kv_capacity_tokens": 100000}  # fmt: skip
    c = prefill_curve(device, chunk=500)
    # 1000 tokens in two chunks of 500: 2 x (10 + 45) ms + the second chunk's 500 x 500 pairs at 1 ns
    assert c.prefill_s(1024) == pytest.approx(prefill_curve(device, chunk=500).prefill_s(1024))
    assert prefill_curve(device, chunk=1 << 20).prefill_s(1024) < c.prefill_s(1024)
    assert c.kv_size(1024) == pytest.approx(1024 * 1000, rel=1e-6)
    assert prefill_curve(device, speedup=4).prefill_s(512) == pytest.approx(
        prefill_curve(device).prefill_s(512) / 4
    )
    rate = decode_rate(device, slo_tokens_per_s=10, context_tokens=500)  # steps under 100 ms
    assert rate.step_s <= 0.1 and rate.max_batch > 1
    with pytest.raises(ValueError, match="SLO"):
        decode_rate(device, slo_tokens_per_s=1000, context_tokens=500)
    table = {
        "name": "t",
        "prefill": {"tokens": [1024], "seconds": [0.5], "kv_mib": [1.0]},
        "decode": {"max_batch": 4, "step_s": 0.05},
    }
    assert decode_rate(table, slo_tokens_per_s=20, context_tokens=0) == DecodeRate(4, 0.05)
    with pytest.raises(ValueError, match="misses the SLO"):
        decode_rate(table, slo_tokens_per_s=40, context_tokens=0)
    with pytest.raises(ValueError, match="no prefill rows"):
        prefill_curve({"name": "x"})
    with pytest.raises(ValueError, match="increasing"):
        prefill_curve({"name": "x", "prefill": {"tokens": [2, 1], "seconds": [1, 1], "kv_bytes": [1, 1]}})


def test_bad_inputs_are_named() -> None:
    stages = Stages(local=LOCAL, decode=DecodeRate(10, 0.1), prfaas=FAST)
    with pytest.raises(ValueError, match="finite longest length"):
        plan(stages, LogNormalLengths(7.0, 1.0), 100, 1, 3)
    with pytest.raises(ValueError, match="chunk"):
        prefill_curve({"name": "d", "base_ms": 1.0, "tokens_ms": [[1, 1.0]]}, chunk=0)
    with pytest.raises(ValueError, match="latencies must be finite and > 0"):
        prefill_curve({"name": "z", "prefill": {"tokens": [1, 2], "seconds": [0, 1], "kv_bytes": [1, 2]}})
