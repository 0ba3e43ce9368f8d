"""Prefix caching in the cluster simulator: a cached group prefix is not computed again, the service's
cache-aware routing keeps a group where it is cached, dynamic PD is shown each instance's uncached
tokens, and eviction keeps the cluster's index of who holds what true."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.cluster_sim.cluster import Cluster, SimConfig
from benchmarks.cluster_sim.instance import SimInstance
from benchmarks.cluster_sim.metrics import summarize
from benchmarks.cluster_sim.trace import LengthMix, PrefixMix, SimRequest, make_trace
from ops.platforms.device_profile import DeviceProfile
from tests.benchmarks.test_cluster_sim import ROOT

PROFILE = DeviceProfile(
    name="t", base_ms=10.0, tokens_ms=[(1, 0.0), (1024, 50.0)], attention_ns=1.0, kv_capacity_tokens=100_000
)


def test_a_cached_prefix_is_not_computed_again() -> None:
    """Two prompts of one group, 1000 shared tokens (62 full blocks = 992) and 200 of their own, one at
    a time: the second computes 208 tokens that attend the 992 cached."""
    first = SimRequest(0, 0.0, 1200, 1, group=7, prefix=1000)
    second = SimRequest(1, 10.0, 1200, 1, group=7, prefix=1000)
    cluster = Cluster(SimConfig("colocated", 1), PROFILE)
    recs = cluster.run([first, second])
    assert recs[0].first_token - first.arrival == pytest.approx(PROFILE.step_seconds([1200], [1200]))
    assert recs[1].first_token - second.arrival == pytest.approx(PROFILE.step_seconds([208], [1200]))
    assert summarize(recs, cluster)["prefix_hit_rate"] == round(992 / 2400, 4)


def test_eviction_drops_the_least_recent_group_from_the_index() -> None:
    """Room for two 1000-token prefixes: a third group evicts the least recently used one."""
    profile = DeviceProfile(**{**PROFILE.__dict__, "kv_capacity_tokens": 2048})
    trace = [SimRequest(g, 10.0 * g, 1010, 1, group=g, prefix=1000) for g in range(3)]
    trace.append(SimRequest(3, 30.0, 1010, 1, group=1, prefix=1000))
    trace.append(SimRequest(4, 40.0, 1010, 1, group=0, prefix=1000))
    cluster = Cluster(SimConfig("colocated", 1), profile)
    recs = cluster.run(trace)
    inst = cluster.instances[0]
    assert recs[3].first_token - 30.0 < recs[4].first_token - 40.0  # group 1 was held, group 0 evicted
    assert cluster.holders[0] == {0} and cluster.holders[2] == set()  # 0 came back, 2 went for it
    assert set(inst.cached) == {1, 0}


def test_a_single_instance_never_evicts_the_prefix_it_just_cached() -> None:
    inst = SimInstance(0, PROFILE, capacity_tokens=64)
    assert inst.remember(SimRequest(0, 0.0, 500, 1, group=3, prefix=480)) == []
    assert inst.matched_tokens(SimRequest(1, 0.0, 500, 1, group=3, prefix=480)) == 480


def test_cache_aware_routing_keeps_groups_where_they_are_cached() -> None:
    trace = make_trace("steady", 1500, 40.0, seed=3, mix=LengthMix(256, 16), prefix=PrefixMix(40, 1024))
    rates = {}
    for routing in ("cache_aware", "least_load"):
        cluster = Cluster(SimConfig("colocated", 8, routing=routing), PROFILE)
        rates[routing] = summarize(cluster.run(trace), cluster)["prefix_hit_rate"]
    assert rates["cache_aware"] > rates["least_load"] > 0, rates
    dynamic = Cluster(SimConfig("dynamic", 8, num_prefill=4), PROFILE)
    result = summarize(dynamic.run(trace), dynamic)
    assert result["prefix_hit_rate"] > 0 and result["num_unfinished"] == 0


def test_the_cli_reports_prefix_hits() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.cluster_sim", "--instances", "4", "--requests", "400",
         "--trace", "steady", "--prefix-groups", "10", "--prefix-tokens", "512", "--splits", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["prefix"] == {"groups": 10, "tokens": 512, "zipf": 1.0} and out["routing"] == "cache_aware"
    assert out["colocated"]["prefix_hit_rate"] > 0 and "prefix_hit_rate" in out["dynamic"]
