"""Smoke runs of the cluster benchmarks (``benchmarks.cluster_routing`` / ``cluster_failover``) over
``benchmarks.cluster_common.LocalCluster``: two tiny engines, a few requests, JSON shape only.

They build the service side from the real cluster components (store, registry, pool, launcher,
supervisor, cluster key); a change to those that breaks the benchmarks fails here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import cluster_failover, cluster_routing

RUN_KEYS = {
    "policy",
    "num_requests",
    "prefix_hit_rate",
    "prefix_hit_rate_follow_up_turns",
    "mean_ttft_ms",
    "p90_ttft_ms",
    "routed",
}


def test_both_parse_their_defaults() -> None:
    assert cluster_routing.build_parser().parse_args([]).conversations > 0
    assert cluster_failover.build_parser().parse_args([]).streams > 0


def test_routing_on_two_tiny_instances(tiny_qwen3: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", str(tiny_qwen3), "--conversations", "2", "--turns", "2"]
    argv += ["--system-tokens", "32", "--question-tokens", "8", "--max-tokens", "2"]
    assert cluster_routing.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["benchmark"] == "cluster_routing" and report["instances"] == 2
    assert [r["policy"] for r in report["results"]] == ["round_robin", "cache_aware"]
    for run in report["results"]:
        assert set(run) == RUN_KEYS
        assert run["num_requests"] == 4 and sum(run["routed"].values()) == 4
        assert set(run["routed"]) == {"engine-0", "engine-1"}
        assert 0 <= run["prefix_hit_rate"] <= 1


@pytest.mark.slow
def test_failover_on_two_tiny_instances(tiny_qwen3: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", str(tiny_qwen3), "--streams", "2", "--max-tokens", "400"]
    assert cluster_failover.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    first, second = report["results"]
    assert first["detection"] == "process_exit_watch" and first["relaunched"]
    assert second["detection"] == "registry_lease_or_heartbeat"
    for result in (first, second):
        assert result["all_completed"] and result["migrated_requests"] >= 1
        assert set(result["kill_to_first_migrated_token_ms"]) == {"min", "mean", "max"}
