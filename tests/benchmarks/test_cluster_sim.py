"""The cluster simulator (``benchmarks/cluster_sim``): its instances follow the device profile exactly
where the answer is known by hand, the service's policies place the requests, runs are deterministic,
and the CLI reports every configuration the issue asks for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.cluster_sim.cluster import Cluster, SimConfig
from benchmarks.cluster_sim.metrics import summarize
from benchmarks.cluster_sim.trace import LengthMix, SimRequest, make_trace
from ops.platforms.device_profile import DeviceProfile, load_profile

ROOT = Path(__file__).resolve().parents[2]
PROFILE = DeviceProfile(
    name="t", base_ms=10.0, tokens_ms=[(1, 0.0), (1024, 50.0)], attention_ns=1.0, kv_capacity_tokens=100_000
)


def test_a_lone_request_takes_the_profiles_prefill_then_decode_steps() -> None:
    req = SimRequest(0, arrival=1.0, prompt=500, output=6)
    cluster = Cluster(SimConfig("colocated", 1), PROFILE)
    rec = cluster.run([req])[0]
    prefill = PROFILE.step_seconds([500], [500])
    assert rec.first_token - req.arrival == pytest.approx(prefill)
    decodes = sum(PROFILE.step_seconds([1], [500 + k]) for k in range(1, 6))
    assert rec.end - rec.first_token == pytest.approx(decodes)


def test_instances_sharing_cores_slow_each_other() -> None:
    """Two prompts at once on two instances sharing one core: the step that starts beside a busy one
    takes twice the profile's time; with a device each, both take it."""
    trace = [SimRequest(0, 0.0, 500, 1), SimRequest(1, 0.0, 500, 1)]
    alone = PROFILE.step_seconds([500], [500])
    shared = Cluster(SimConfig("colocated", 2, cores=1.0), PROFILE).run(trace)
    assert sorted(r.first_token for r in shared.values()) == pytest.approx([alone, 2 * alone])
    own = Cluster(SimConfig("colocated", 2), PROFILE).run(trace)
    assert [r.first_token for r in own.values()] == pytest.approx([alone, alone])


def test_pd_moves_the_kv_and_the_split_decides_the_slo() -> None:
    profile = DeviceProfile(**{**PROFILE.__dict__, "kv_bytes_per_token": 1000, "transfer_gbps": 8.0})
    req = SimRequest(0, arrival=0.0, prompt=500, output=3)
    rec = Cluster(SimConfig("static", 2, num_prefill=1), profile).run([req])[0]
    transfer = 500 * 1000 / 1e9  # 8 Gb/s = 1 GB/s
    decodes = sum(profile.step_seconds([1], [500 + k]) for k in range(1, 3))
    assert rec.end - rec.first_token == pytest.approx(transfer + decodes)
    handed = Cluster(SimConfig("static", 2, num_prefill=1, handoff_ms=40.0), profile).run([req])[0]
    assert handed.end - handed.first_token == pytest.approx(transfer + 0.04 + decodes)  # export, import
    trace = make_trace("shifting", 3000, rate=60.0, seed=1, mix=LengthMix(1024, 128))
    results = {}
    for p in (1, 4, 7):
        cluster = Cluster(SimConfig("static", 8, num_prefill=p, ttft_slo_s=1.0, tpot_slo_s=0.05), profile)
        results[p] = summarize(cluster.run(trace), cluster)
    assert results[1]["slo_attainment"] < results[4]["slo_attainment"]  # one prefill instance drowns
    assert all(r["num_unfinished"] == 0 for r in results.values())


def test_dynamic_pd_flips_under_a_shifting_trace_and_runs_are_deterministic() -> None:
    trace = make_trace("shifting", 3000, rate=60.0, seed=2, mix=LengthMix(1024, 128))
    config = dict(num_instances=8, num_prefill=2, ttft_slo_s=1.0, tpot_slo_s=0.05)
    runs = []
    for _ in range(2):
        cluster = Cluster(SimConfig("dynamic", **config, policy={"cooldown_s": 2.0}), PROFILE)
        runs.append(summarize(cluster.run(trace), cluster))
    assert runs[0] == runs[1]
    assert runs[0]["num_flips"] > 0 and runs[0]["num_unfinished"] == 0


def test_the_cli_reports_every_configuration() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.cluster_sim", "--instances", "6", "--requests", "800", "--trace", "bursty"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert [s["num_prefill"] for s in out["static"]] == [1, 2, 3, 4, 5]
    for result in [out["dynamic"], out["colocated"], *out["static"]]:
        assert 0 <= result["slo_attainment"] <= 1 and result["goodput"] >= 0
        assert set(result["ttft_s"]) == {"p50", "p90", "p99"} and result["num_requests"] == 800
    assert "num_flips" in out["dynamic"] and out["simulated_requests"] == 800 * 7 and "wall_s" in out


def test_dynamic_pd_beats_every_static_split_when_the_mix_shifts() -> None:
    """Prefill-heavy (long prompts) then decode-heavy (short prompts, longer outputs) on the decode-bound
    profile: every static split of 8 fails one phase; dynamic PD, starting from 4P4D, lends a decode
    instance to prefill while the prefill queue builds (before the TTFT SLO is missed) and keeps up
    with both. The old rule (flip only once a prompt is predicted to miss the SLO, place on the P pool
    while anything under the SLO is predicted) does worse."""
    profile = load_profile(str(ROOT / "benchmarks/cluster_sim/profiles/decode-bound-accelerator.json"))
    rng = np.random.default_rng(0)
    trace, t = [], 0.0
    for n, prompt, output, rate in ((200, 1500, 16, 14.0), (130, 32, 64, 6.5)):
        for _ in range(n):
            t += rng.exponential(1 / rate)
            trace.append(SimRequest(len(trace), t, prompt, output))
    base = dict(num_instances=8, ttft_slo_s=3.0, tpot_slo_s=0.3, max_seqs=64, policy={"cooldown_s": 3.0})

    def attainment(config: SimConfig) -> float:
        cluster = Cluster(config, profile)
        return summarize(cluster.run(trace), cluster)["slo_attainment"]

    static = {p: attainment(SimConfig("static", num_prefill=p, **base)) for p in range(1, 8)}
    dynamic = attainment(SimConfig("dynamic", num_prefill=4, **base))
    old = {**base, "policy": {"cooldown_s": 3.0, "backlog": 1e9, "headroom": 1.0}}
    old_rule = attainment(SimConfig("dynamic", num_prefill=4, **old))
    assert dynamic > max(max(static.values()), old_rule), (dynamic, static, old_rule)


def test_a_profile_written_from_published_numbers_reproduces_them() -> None:
    """``h200x8-prfaas-table5-prefill.json``: the Prefill-as-a-Service paper's Table 5 prefill latencies
    and KV sizes of its 1T hybrid model on 8 H200s, as the profile predicts them."""
    path = ROOT / "benchmarks/cluster_sim/profiles/h200x8-prfaas-table5-prefill.json"
    profile = load_profile(str(path))
    table5 = {1024: (0.44, 190.8), 8192: (0.72, 308.9), 32768: (1.84, 701.3), 131072: (7.40, 2316.3)}
    for tokens, (latency_s, _) in table5.items():
        assert profile.step_seconds([tokens], [tokens]) == pytest.approx(latency_s, rel=0.01)
    growth = (table5[131072][1] - table5[1024][1]) * 2**20 / (131072 - 1024)  # KV bytes per extra token
    assert profile.kv_bytes_per_token == pytest.approx(growth, rel=0.001)
