"""Online/offline co-location in the cluster simulator (``benchmarks/cluster_sim/colocation.py``): the
service's ``ColocationPolicy`` keeps offline decodes off latency-strict instances that cannot take
them, evicts them when online load rises, and every request's KV and context is accounted for."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.cluster_sim.cluster import Cluster, SimConfig
from benchmarks.cluster_sim.instance import SimInstance
from benchmarks.cluster_sim.metrics import summarize
from benchmarks.cluster_sim.trace import LengthMix, PrefixMix, SimRequest, make_trace
from ops.platforms.device_profile import load_profile
from tests.benchmarks.test_cluster_sim import PROFILE, ROOT

DECODE_BOUND = load_profile(str(ROOT / "benchmarks/cluster_sim/profiles/decode-bound-accelerator.json"))
SLOS = dict(ttft_slo_s=3.0, tpot_slo_s=0.3)


def run(config: SimConfig, trace: list[SimRequest]) -> tuple[Cluster, dict]:
    cluster = Cluster(config, DECODE_BOUND)
    return cluster, summarize(cluster.run(trace), cluster)


def test_colocation_keeps_the_online_slo_where_offline_work_placed_as_online_breaks_it() -> None:
    """Half the requests offline, 4P4D on the decode-bound profile at 10 requests per second: placed like
    online requests, offline decodes crowd the decode instances and nearly every online request misses
    its TPOT; co-located, offline decodes stay on the prefill side unless a decode batch has room, the
    online SLO holds, and the offline work gets the same throughput."""
    trace = make_trace("steady", 3000, 10.0, seed=1, mix=LengthMix(750, 32), offline_share=0.5)
    _, plain = run(SimConfig("static", 8, num_prefill=4, **SLOS), trace)
    _, coloc = run(SimConfig("static", 8, num_prefill=4, colocation=True, **SLOS), trace)
    assert plain["slo_attainment"] < 0.5 < 0.9 < coloc["slo_attainment"], (plain, coloc)
    assert coloc["offline"]["throughput"] >= 0.95 * plain["offline"]["throughput"]
    assert coloc["offline"]["decodes_strict"] > 0 and coloc["offline"]["decodes_relaxed"] > 0
    assert coloc["num_requests"] + coloc["offline"]["num_requests"] == 3000


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_evicted_decodes_finish_and_every_instance_ends_empty(mode: str) -> None:
    """Bursty arrivals with shared prefixes: offline decodes are moved off strict instances as bursts come,
    every request still finishes, and each instance's batch, context and KV return to zero."""
    trace = make_trace(
        "bursty", 3000, 14.0, seed=2, mix=LengthMix(750, 32), offline_share=0.5, prefix=PrefixMix(20, 256)
    )
    cluster, result = run(SimConfig(mode, 8, num_prefill=4, colocation=True, **SLOS), trace)
    assert result["offline"]["evictions"] > 0
    assert result["num_unfinished"] == 0 and result["offline"]["num_unfinished"] == 0
    for inst in cluster.instances:
        assert (inst.num_decoding, inst.ctx_sum, inst.reserved, inst.num_inflight) == (0, 0, 0, 0)


def test_a_moved_decode_keeps_its_context_and_remaining_tokens() -> None:
    inst = SimInstance(0, PROFILE)
    req = SimRequest(5, 0.0, 100, 10, offline=True)
    inst.add_decode(req)
    for _ in range(3):  # three decode steps: tokens 2..4 made, 6 left
        inst.start_step(0.0)
        inst.finish_step()
    assert inst.offline_decodes() == [(5, 104)]
    inst.evict(5)
    inst.start_step(0.0)
    moved = inst.finish_step().moved
    assert [(m.rid, m.prompt + 1, m.output - 1, m.offline) for m in moved] == [(5, 105, 5, True)]
    assert (inst.num_decoding, inst.ctx_sum, inst.reserved) == (0, 0, 0)


def test_a_decode_joining_during_a_step_waits_for_the_next() -> None:
    """A sequence that joins while a step is in flight is not in that step: all of its tokens still come."""
    inst = SimInstance(0, PROFILE)
    inst.add_decode(SimRequest(0, 0.0, 100, 3))  # 2 tokens to decode
    inst.start_step(0.0)
    inst.add_decode(SimRequest(1, 0.0, 100, 3))  # mid-step
    ends = [inst.finish_step().decoded]  # (nothing ends in step 1)
    for _ in range(3):
        inst.start_step(0.0)
        ends.append(inst.finish_step().decoded)
        for rid in ends[-1]:
            inst.forget_decoded(rid)
    assert ends == [[], [0], [1], []]  # 0: steps 1 and 2; 1: steps 2 and 3
    assert (inst.num_decoding, inst.ctx_sum) == (0, 0)


def test_colocation_needs_a_pd_split() -> None:
    with pytest.raises(ValueError, match="P/D split"):
        Cluster(SimConfig("colocated", 4, colocation=True), PROFILE)


def test_the_cli_reports_offline_throughput() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.cluster_sim", "--instances", "4", "--requests", "400",
         "--trace", "steady", "--offline-share", "0.3", "--splits", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["colocation"] is True and out["offline_share"] == 0.3
    assert out["static"][0]["offline"]["num_unfinished"] == 0
    assert out["dynamic"]["offline"]["num_requests"] == out["colocated"]["offline"]["num_requests"] > 0
