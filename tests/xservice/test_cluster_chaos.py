"""Chaos: a 3-engine cluster under a stream of greedy requests, random ``kill -9`` of engines (each
relaunched by the supervisor) and one etcd restart. Every request completes with the output of a
no-fault run, and the cluster heals back to 3 healthy engines.

The default run is short; ``-m slow`` runs a longer soak (more requests and kills). Each run prints
its numbers (requests, kills, restarts, time to heal) as one JSON line.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from test_cluster_serving import TTL_S, ClusterServer, wait_until
from test_cluster_store import EtcdServer, etcd  # noqa: F401 - the module-scoped etcd fixture

NAMES = ["engine-0", "engine-1", "engine-2"]
MAX_TOKENS = 40
GUARD_S = 600.0  # a broken build must not hang the suite; not a timing assertion


@pytest.fixture(scope="module")
def cluster(etcd: EtcdServer, model_dir: Path) -> Iterator[ClusterServer]:  # noqa: F811
    server = ClusterServer(
        model_dir,
        {
            "instances": ",".join(f"{n}:mixed" for n in NAMES),
            "metadata_store": "etcd",
            "etcd_endpoint": etcd.endpoint,
            "key_prefix": "/xllm-chaos",
            "routing_policy": "least_load",
        },
        {"engine_restart_backoff_s": 0.5, "engine_max_restarts": 50},
    )
    yield server
    server.stop()


def _prompt(i: int) -> str:
    return f"Request {i}: the history of the {['sea', 'mountain', 'city', 'river'][i % 4]} begins with"


def _run(client: openai.OpenAI, i: int) -> tuple[str, str | None]:
    kw: dict[str, Any] = dict(
        model="xllm-tiny",
        prompt=_prompt(i),
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    if i % 2:  # half streamed, half not
        parts, finish = [], None
        for chunk in client.completions.create(stream=True, **kw):
            parts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        return "".join(parts), finish
    out = client.completions.create(**kw)
    return out.choices[0].text, out.choices[0].finish_reason


def _healthy(cluster: ClusterServer) -> dict[str, dict[str, Any]]:
    return {n: i for n, i in cluster.instances().items() if i["healthy"]}


def _restarts(cluster: ClusterServer) -> float:
    total = 0.0
    for line in cluster.http.get("/metrics").text.splitlines():
        if line.startswith("xllm_engine_restarts_total{"):
            total += float(line.split()[-1])
    return total


def _chaos(cluster: ClusterServer, etcd_server: EtcdServer, num_kills: int, seed: int) -> dict[str, Any]:
    """Kill a random healthy engine with work in flight (never the last one) ``num_kills`` times, each
    once the previous one healed; restart etcd once, while an engine is down."""
    rng = random.Random(seed)
    heal_s: list[float] = []
    for kill in range(num_kills):
        time.sleep(rng.uniform(0.5, 1.5))
        wait_until(lambda: len(_healthy(cluster)) >= 2, 120, "two healthy engines")
        healthy = _healthy(cluster)
        busy = sorted(n for n, i in healthy.items() if i["num_inflight"]) or sorted(healthy)
        victim = healthy[rng.choice(busy)]
        os.kill(victim["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        if kill == num_kills // 2:
            etcd_server.stop()
            time.sleep(1.0)
            etcd_server.start()
        wait_until(
            lambda v=victim: (
                (i := cluster.instances().get(v["name"])) is not None
                and i["healthy"]
                and i["incarnation"] != v["incarnation"]
            ),
            120,
            f"{victim['name']} to be relaunched",
        )
        heal_s.append(time.monotonic() - killed_at)
    return {"kills": num_kills, "heal_s": heal_s}


def _chaos_run(
    cluster: ClusterServer, etcd_server: EtcdServer, num_prompts: int, num_kills: int, seed: int
) -> None:
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{cluster.port}/v1", api_key="x", max_retries=0, timeout=GUARD_S
    )
    wait_until(lambda: len(_healthy(cluster)) == 3, 120, "3 healthy engines")
    with ThreadPoolExecutor(4) as pool:  # the no-fault run
        expected = list(pool.map(lambda i: _run(client, i), range(num_prompts)))
    assert all(finish == "length" for _, finish in expected)

    restarts_before = _restarts(cluster)
    migrations_before = cluster.admin()["num_migrations"]
    done = threading.Event()
    counter = itertools.count()
    mismatches: list[tuple[int, Any]] = []
    completed = [0]

    def client_loop() -> None:  # requests keep coming until the chaos is over
        while not done.is_set():
            i = next(counter) % num_prompts
            try:
                result: Any = _run(client, i)
            except Exception as e:  # noqa: BLE001 - reported below
                result = repr(e)
            if result != expected[i]:
                mismatches.append((i, result))
            completed[0] += 1

    started = time.monotonic()
    workers = [threading.Thread(target=client_loop) for _ in range(6)]
    [w.start() for w in workers]
    try:
        report = _chaos(cluster, etcd_server, num_kills, seed)
    finally:
        done.set()
        [w.join(GUARD_S) for w in workers]
    assert mismatches == []  # every request completed, token-identical to the no-fault run

    wait_until(lambda: len(_healthy(cluster)) == 3, 120, "the cluster to heal to 3 healthy engines")
    restarts = _restarts(cluster) - restarts_before
    migrations = cluster.admin()["num_migrations"] - migrations_before
    assert restarts == num_kills and migrations > 0
    heal = sorted(report["heal_s"])
    print(
        json.dumps(
            {
                "requests": completed[0],
                "kills": report["kills"],
                "restarts": restarts,
                "etcd_restarts": 1,
                "migrations": migrations,
                "time_to_heal_s": {"median": round(heal[len(heal) // 2], 2), "max": round(heal[-1], 2)},
                "duration_s": round(time.monotonic() - started, 1),
                "lease_ttl_s": TTL_S,
            }
        )
    )


def test_chaos_short(cluster: ClusterServer, etcd: EtcdServer) -> None:  # noqa: F811
    _chaos_run(cluster, etcd, num_prompts=24, num_kills=3, seed=1)


@pytest.mark.slow
def test_chaos_soak(cluster: ClusterServer, etcd: EtcdServer) -> None:  # noqa: F811
    _chaos_run(cluster, etcd, num_prompts=48, num_kills=12, seed=2)
