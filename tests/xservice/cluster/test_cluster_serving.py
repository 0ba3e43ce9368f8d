"""Cluster mode end to end: ``xllm serve`` with two real engine instances registered in a real etcd.

One service (launched through the CLI with a cluster config) for the whole module; the tests run
in file order: registration, stale incarnations, cache-aware routing, an etcd restart, then a
``kill -9`` of an engine in the middle of several streams (migration) and its relaunch taking the name over.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.xservice.cluster.helpers import (
    HEARTBEAT_S,
    ClusterServer,
    EtcdServer,
    complete,
    freeze_a_busy_instance,
    start_streams,
    wait_until,
)

PREFIX = "/xllm-test"
# longer than the kill test's guards together (2 x 120 s), so a killed instance's record outlives its
# relaunch: the relaunch can register only by taking the name over from the dead incarnation (a crash is
# seen through the process exit; the registry declares a silent instance dead only after the lease)
LEASE_TTL_S = 300.0


@pytest.fixture(scope="module")
def cluster(etcd: EtcdServer, model_dir: Path) -> Iterator[ClusterServer]:
    server = ClusterServer(
        model_dir,
        {
            "instances": "engine-0:mixed,engine-1:mixed",
            "metadata_store": "etcd",
            "etcd_endpoint": etcd.endpoint,
            "key_prefix": PREFIX,
            "routing_policy": "cache_aware",
            "lease_ttl_s": LEASE_TTL_S,
            "heartbeat_interval_s": HEARTBEAT_S,
        },
    )
    yield server
    server.stop()


def etcd_keys(etcd: EtcdServer, kind: str) -> dict[str, bytes]:
    from xengine.api.cluster.store.etcd import EtcdStore

    async def read() -> dict[str, bytes]:
        store = EtcdStore("127.0.0.1", etcd.port)
        try:
            data, _ = await store.get_prefix(f"{PREFIX}/{kind}/")
            return {k.rsplit("/", 1)[1]: v for k, v in data.items()}
        finally:
            await store.close()

    return asyncio.run(read())


def test_instances_register_with_roles_under_a_lease(cluster: ClusterServer, etcd: EtcdServer) -> None:
    instances = cluster.instances()
    assert sorted(instances) == ["engine-0", "engine-1"]
    assert all(i["healthy"] and i["role"] == "mixed" for i in instances.values())
    registered = etcd_keys(etcd, "instances")
    assert sorted(registered) == ["engine-0", "engine-1"]
    wait_until(lambda: all(i["load"] for i in cluster.instances().values()), what="heartbeats")


def test_stale_incarnation_reports_are_rejected(cluster: ClusterServer, etcd: EtcdServer) -> None:
    from xengine.api.cluster import keys
    from xengine.api.cluster.store.etcd import EtcdStore

    before = cluster.admin()["num_stale_rejected"]
    real = cluster.instances()["engine-0"]["incarnation"]

    async def write_stale() -> None:
        store = EtcdStore("127.0.0.1", etcd.port)
        report = keys.LoadReport(incarnation="a-previous-process", seq=10**6, num_waiting=999)
        await store.put(f"{PREFIX}/load/engine-0", keys.encode(report))
        await store.close()

    asyncio.run(write_stale())
    wait_until(lambda: cluster.admin()["num_stale_rejected"] > before, what="stale rejection")
    load = cluster.instances()["engine-0"]["load"]
    assert load["incarnation"] == real and load["num_waiting"] != 999


def test_cache_aware_routes_a_shared_prefix_follow_up_to_its_holder(cluster: ClusterServer) -> None:
    client = cluster.openai()
    shared = "You are a helpful assistant. " * 12  # ~6 full blocks
    before = {n: i["num_routed"] for n, i in cluster.instances().items()}
    indexed = {n: i["num_kv_blocks_indexed"] for n, i in cluster.instances().items()}
    complete(client, shared + "Question one?")
    after = {n: i["num_routed"] for n, i in cluster.instances().items()}
    holder = next(n for n in after if after[n] > before[n])
    # counted from before: the earlier tests' blocks are indexed there too
    wait_until(
        lambda: cluster.instances()[holder]["num_kv_blocks_indexed"] >= indexed[holder] + 5, what="KV events"
    )
    for q in ("Question two?", "Question three?", "Question four?"):
        out = complete(client, shared + q)
        assert out.usage.prompt_tokens_details.cached_tokens >= 5 * 16
    final = {n: i["num_routed"] for n, i in cluster.instances().items()}
    assert final[holder] - after[holder] == 3
    assert all(final[n] == after[n] for n in final if n != holder)


def test_vllm_named_metrics_sum_the_instances(cluster: ClusterServer) -> None:
    """Cluster mode exports vLLM's metric names too: engine counters are the instances' sums."""
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(cluster.http.get("/metrics").text)
    values = {s.name: s for f in families for s in f.samples}
    hits = values["vllm:prefix_cache_hits_total"]
    assert hits.labels == {"model_name": "xllm-tiny", "engine": "0"}
    assert hits.value >= 3 * 5 * 16  # the cache-aware follow-ups above each hit >= 5 blocks
    assert values["vllm:prompt_tokens_total"].value == values["xllm_prompt_tokens_total"].value > 0
    assert "vllm:num_requests_running" in values and "vllm:kv_cache_usage_perc" in values


def test_item_catalogs_are_refused_by_a_cluster(cluster: ClusterServer) -> None:
    """A catalog lives in one engine's memory: the pool serves none, and says so with a 400."""
    resp = cluster.http.post("/v1/rec/catalogs", json={"name": "shop", "items": [[5, 6], [7, 8]]})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "name", error
    assert "single-node" in error["message"]
    listed = cluster.http.get("/v1/rec/catalogs")
    assert listed.status_code == 200 and listed.json()["data"] == [], listed.text


def test_serving_continues_while_etcd_is_down_and_instances_reregister(
    cluster: ClusterServer,
    etcd: EtcdServer,
) -> None:
    client = cluster.openai()
    etcd.stop()
    try:
        wait_until(lambda: not cluster.admin()["store_ok"], what="the registry to notice etcd is down")
        for i in range(3):
            assert complete(client, f"etcd is down, request {i}").choices[0].finish_reason == "length"
        assert all(i["healthy"] for i in cluster.instances().values())
    finally:
        etcd.start()
    wait_until(lambda: cluster.admin()["store_ok"], what="the registry to resync")
    wait_until(
        lambda: sorted(etcd_keys(etcd, "instances")) == ["engine-0", "engine-1"], what="re-registration"
    )
    seqs = {n: i["load"]["seq"] for n, i in cluster.instances().items()}
    wait_until(
        lambda: all(i["load"]["seq"] > seqs[n] for n, i in cluster.instances().items()),
        what="fresh heartbeats",
    )
    assert complete(client, "etcd is back").choices[0].finish_reason == "length"


def test_kill_9_mid_stream_migrates_requests_without_losing_or_repeating_tokens(
    cluster: ClusterServer,
    etcd: EtcdServer,
) -> None:
    client = cluster.openai()
    baseline: dict[str, Any] = {}
    [t.join(120) for t in start_streams(client, baseline)]
    assert not [k for k in baseline if k.endswith(":error")], baseline

    faulty: dict[str, Any] = {}
    threads = start_streams(client, faulty)
    victim = wait_until(lambda: freeze_a_busy_instance(cluster), 60, "an instance with streams in flight")
    os.kill(victim["pid"], signal.SIGKILL)  # frozen until now: its streams could not finish meanwhile
    [t.join(120) for t in threads]

    for i in range(4):
        assert f"{i}:error" not in faulty, faulty[f"{i}:error"]
        assert faulty[f"{i}:finish"] == "length"
        assert "".join(faulty[str(i)]) == "".join(baseline[str(i)]), f"stream {i} differs"
    assert cluster.admin()["num_migrations"] >= 1

    # the supervisor relaunches the instance under its name, with a new incarnation that takes the name
    # over from the dead one (no wait for its lease), and it serves again
    def registered_incarnation() -> str | None:
        raw = etcd_keys(etcd, "instances").get(victim["name"])
        assert raw is not None, "the dead registration ended before the relaunch took the name over"
        return json.loads(raw)["incarnation"]

    wait_until(
        lambda: registered_incarnation() != victim["incarnation"], 120, "the dead registration replaced"
    )
    assert f"took the name {victim['name']} over from dead incarnation {victim['incarnation']}" in (
        cluster.log_path.read_text()
    )
    wait_until(lambda: cluster.instances().get(victim["name"], {}).get("healthy"), 120, "the relaunch")
    assert cluster.instances()[victim["name"]]["incarnation"] != victim["incarnation"]
    metrics = cluster.http.get("/metrics").text
    assert f'xllm_engine_restarts_total{{instance="{victim["name"]}"}} 1.0' in metrics
    assert complete(client, "after the failure").choices[0].finish_reason == "length"
