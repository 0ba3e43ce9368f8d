"""Failover that restores KV: a cluster of two mixed instances sharing a Mooncake Store tier (a real
``mooncake_master`` and its memory, which the service starts: ``kv_tiers.store_master: auto``) and a
real etcd. Every listener of the service, its engines and the store is on loopback. A stream's instance is
killed (``kill -9``) mid-stream; the request migrates to the other instance, which loads the prompt and
the tokens streamed so far from the store (written through by the dead instance) and computes only the
tail past the last whole block: the survivor's computed prompt tokens say so. The text equals the run
without the fault."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.xservice.cluster.helpers import (
    HEARTBEAT_S,
    ClusterServer,
    EtcdServer,
    freeze_a_busy_instance,
    process_tree,
    tcp_listeners,
    wait_until,
)

BS = 16
PROMPT = "Long story: " + " ".join(f"w{i}" for i in range(40))  # ~115 tokens of the tiny tokenizer
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def cluster(etcd: EtcdServer, model_dir: Path) -> Iterator[ClusterServer]:
    server = ClusterServer(
        model_dir,
        {
            "instances": "engine-0:mixed,engine-1:mixed",
            "metadata_store": "etcd",
            "etcd_endpoint": etcd.endpoint,
            "key_prefix": "/xllm-kv-tiers-test",
            "routing_policy": "cache_aware",
            "lease_ttl_s": 3.0,
            "heartbeat_interval_s": HEARTBEAT_S,
        },
        engine={
            "kv_tiers": {"store_master": "auto", "store_memory_gb": 0.25},
            "model": {"max_model_len": 512},
        },
    )
    yield server
    server.stop()


def test_the_service_its_engines_and_the_store_listen_on_loopback_only(cluster: ClusterServer) -> None:
    tree = process_tree(cluster.proc.pid)
    listening = tcp_listeners(tree)
    names = {pid: open(f"/proc/{pid}/comm").read().strip() for pid in listening}
    assert "mooncake_master" in names.values()  # started by the service (store_master: auto)
    engines = {i["pid"] for i in cluster.instances().values()}
    assert engines <= set(listening)
    for pid, addrs in listening.items():
        assert all(host in ("127.0.0.1", "::ffff:127.0.0.1", "::1") for host, _ in addrs), (names[pid], addrs)


def _stream(cluster: ClusterServer, out: list[str]) -> None:
    client = cluster.openai()
    for chunk in client.completions.create(
        model="xllm-tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    ):  # fmt: skip
        out.append(chunk.choices[0].text)


def _instance_stats(cluster: ClusterServer) -> dict[str, Any]:
    return cluster.http.get("/v1/admin/stats").json()["instances"]


def test_a_migrated_request_loads_its_kv_from_the_store(cluster: ClusterServer) -> None:
    baseline: list[str] = []
    _stream(cluster, baseline)
    stats = _instance_stats(cluster)
    holder = max(stats.items(), key=lambda kv: kv[1]["num_computed_prompt_tokens"])[0]
    survivor = next(n for n in stats if n != holder)
    before = stats[survivor]  # idle until the migrated request comes (a frozen instance's lease runs out)

    chunks: list[str] = []
    idle = lambda: all(i["load"]["num_running"] == 0 for i in cluster.instances().values())  # noqa: E731
    wait_until(idle, 30, "heartbeats saying both instances are idle")
    thread = threading.Thread(target=_stream, args=(cluster, chunks))
    thread.start()  # cache-aware routing sends it to the holder of its prefix in L1 again
    victim = wait_until(  # past its first blocks of output, then frozen (its stream cannot finish)
        lambda: len(chunks) >= 20 and freeze_a_busy_instance(cluster), 60, "the stream's instance frozen"
    )
    assert victim["name"] == holder
    streamed = len(chunks)
    os.kill(victim["pid"], signal.SIGKILL)
    thread.join(120)
    assert "".join(chunks) == "".join(baseline)
    assert cluster.admin()["num_migrations"] >= 1

    after = _instance_stats(cluster)[survivor]
    store_hits = next(t for t in after["kv_tiers"]["tiers"] if t["name"] == "store")["hits"]
    store_hits -= next(t for t in before["kv_tiers"]["tiers"] if t["name"] == "store")["hits"]
    recomputed = after["num_computed_prompt_tokens"] - before["num_computed_prompt_tokens"]
    # the migrated prompt is the original prompt plus the tokens streamed before the kill: its whole
    # blocks came from the store, so the survivor computed at most the tail past the last one
    assert store_hits * BS >= streamed, (store_hits, streamed)
    # the service's index learnt from the instances' KV events what they wrote to the store, and the
    # survivor's heartbeats carry what routing prices an L3 hit with: its measured block load time
    # from the store against its measured prefill time per token
    assert cluster.admin()["kv_store_blocks_indexed"] >= store_hits

    def priced() -> dict[str, Any] | None:
        load = cluster.instances()[survivor]["load"]
        return load if load.get("tier_block_load_ms", {}).get("store") and load["prefill_token_ms"] else None

    load = wait_until(priced, 30, "the survivor's heartbeat with its measured load and prefill times")
    assert 0 < load["tier_block_load_ms"]["store"] < 1000
    assert recomputed < 2 * BS, recomputed
