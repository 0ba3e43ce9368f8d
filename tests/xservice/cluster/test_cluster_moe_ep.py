"""Cluster mode with expert-parallel instances: two engine instances of a MoE model, each two processes
(``parallel.expert_parallel_size: 2``), registered in a real etcd. ``kill -9`` of one *worker* (not the
engine process) in the middle of streams takes its instance down, and the service migrates the streams to
the other instance without losing or repeating a token; the instance is relaunched and serves again.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from tests.xservice.cluster.helpers import (
    HEARTBEAT_S,
    TTL_S,
    ClusterServer,
    EtcdServer,
    complete,
    start_streams,
    wait_until,
)


@pytest.fixture(scope="module")
def cluster(etcd: EtcdServer, make_model_dir) -> Iterator[ClusterServer]:
    server = ClusterServer(
        make_model_dir("qwen3_moe"),
        {
            "instances": "moe-0:mixed,moe-1:mixed",
            "metadata_store": "etcd",
            "etcd_endpoint": etcd.endpoint,
            "key_prefix": "/xllm-test-moe-ep",
            "routing_policy": "round_robin",
            "lease_ttl_s": TTL_S,
            "heartbeat_interval_s": HEARTBEAT_S,
        },
        engine={"model": {"served_model_name": "xllm-tiny"}, "parallel": {"expert_parallel_size": 2}},
    )
    yield server
    server.stop()


def _worker_pid(engine_pid: int) -> int:
    out = subprocess.run(
        ["pgrep", "-P", str(engine_pid), "-f", "xengine.parallel.worker"], capture_output=True, text=True
    )
    pids = [int(x) for x in out.stdout.split()]
    assert len(pids) == 1, f"expected one expert-parallel worker under engine {engine_pid}, got {pids}"
    return pids[0]


def test_kill_9_of_a_worker_mid_stream_migrates_to_the_other_instance(cluster: ClusterServer) -> None:
    client = cluster.openai()
    baseline: dict[str, Any] = {}
    threads = start_streams(client, baseline)
    [t.join(120) for t in threads]
    assert not [k for k in baseline if k.endswith(":error")], baseline

    faulty: dict[str, Any] = {}
    threads = start_streams(client, faulty)
    wait_until(lambda: all(len(faulty.get(str(i), ())) >= 3 for i in range(4)), 60, "streams to start")
    victim = max(cluster.instances().values(), key=lambda i: i["num_inflight"])
    assert victim["num_inflight"] > 0
    os.kill(_worker_pid(victim["pid"]), signal.SIGKILL)
    [t.join(120) for t in threads]

    for i in range(4):
        assert f"{i}:error" not in faulty, faulty[f"{i}:error"]
        assert faulty[f"{i}:finish"] == "length"
        assert "".join(faulty[str(i)]) == "".join(baseline[str(i)]), f"stream {i} differs"
    assert cluster.admin()["num_migrations"] >= 1

    # the instance whose worker died is relaunched (new engine, new workers) and serves again
    def relaunched() -> bool:
        now = cluster.instances().get(victim["name"], {})
        return bool(now.get("healthy")) and now.get("incarnation") != victim["incarnation"]

    wait_until(relaunched, 180, "the relaunch")
    for _ in range(2):  # round robin: both instances answer
        assert complete(client, "after the failure").choices[0].finish_reason == "length"
    assert "xllm_moe_comm_exposed_seconds" in cluster.http.get("/metrics").text
