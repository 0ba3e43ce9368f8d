"""Chaos: a 3-engine cluster under a stream of greedy requests and a seeded random schedule of three
faults: ``kill -9`` of an engine (relaunched by the supervisor), ``SIGSTOP`` of an engine for longer
than its lease (its streams migrate; once resumed, the same process rejoins as a new incarnation,
with no relaunch), and an etcd restart. Every request completes with the output of a no-fault run,
and the cluster heals back to 3 healthy engines after each fault.

The default run has each fault once, in a seeded random order; ``-m slow`` runs a longer soak (more
requests and faults). Each run prints its numbers (requests, faults, restarts, migrations, time to
heal per fault kind) as one JSON line.
"""

from __future__ import annotations

import asyncio
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

from tests.xservice.cluster.helpers import TTL_S, ClusterServer, EtcdServer, wait_until

NAMES = ["engine-0", "engine-1", "engine-2"]
PREFIX = "/xllm-chaos"
MAX_TOKENS = 40
GUARD_S = 600.0  # a broken build must not hang the suite; not a timing assertion


@pytest.fixture(scope="module")
def cluster(etcd: EtcdServer, model_dir: Path) -> Iterator[ClusterServer]:
    server = ClusterServer(
        model_dir,
        {
            "instances": ",".join(f"{n}:mixed" for n in NAMES),
            "metadata_store": "etcd",
            "etcd_endpoint": etcd.endpoint,
            "key_prefix": PREFIX,
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


FAULTS = ("kill", "stop", "etcd")


def _schedule(rng: random.Random, num_faults: int) -> list[str]:
    """Every fault kind once, then random ones, all in a random order."""
    faults = [*FAULTS, *(rng.choice(FAULTS) for _ in range(num_faults - len(FAULTS)))]
    rng.shuffle(faults)
    return faults


def _registered(etcd_server: EtcdServer, name: str) -> bool:
    from xengine.api.cluster.store.etcd import EtcdStore

    async def read() -> bool:
        store = EtcdStore("127.0.0.1", etcd_server.port)
        try:
            return await store.get(f"{PREFIX}/instances/{name}") is not None
        finally:
            await store.close()

    return asyncio.run(read())


def _back(cluster: ClusterServer, victim: dict[str, Any], what: str) -> dict[str, Any]:
    """The victim's name healthy again under a new incarnation."""

    def back() -> dict[str, Any] | None:
        i = cluster.instances().get(victim["name"])
        return i if i is not None and i["healthy"] and i["incarnation"] != victim["incarnation"] else None

    return wait_until(back, 120, f"{victim['name']} to be {what}")


def _fault(cluster: ClusterServer, etcd_server: EtcdServer, kind: str, victim: dict[str, Any]) -> float:
    """Inflict one fault; returns the seconds from its end (kill, SIGCONT, etcd start) to healed."""
    if kind == "kill":
        os.kill(victim["pid"], signal.SIGKILL)
        ended = time.monotonic()
        assert _back(cluster, victim, "relaunched")["pid"] != victim["pid"]
    elif kind == "stop":
        os.kill(victim["pid"], signal.SIGSTOP)
        try:  # longer than the lease: etcd dropped its key, the service failed its streams over
            wait_until(
                lambda: not _registered(etcd_server, victim["name"]), 60, "the stopped one's lease to end"
            )
            wait_until(lambda: victim["name"] not in _healthy(cluster), 60, "the service to fence it off")
        finally:
            os.kill(victim["pid"], signal.SIGCONT)
        ended = time.monotonic()
        assert _back(cluster, victim, "routed again")["pid"] == victim["pid"]  # rejoined, not relaunched
    else:
        etcd_server.stop()
        try:
            wait_until(lambda: not cluster.admin()["store_ok"], 60, "the registry to notice etcd is down")
        finally:
            etcd_server.start()
        ended = time.monotonic()
        wait_until(lambda: cluster.admin()["store_ok"], 60, "the registry to resync")
    wait_until(lambda: len(_healthy(cluster)) == 3, 120, "the cluster to heal to 3 healthy engines")
    return time.monotonic() - ended


def _chaos(cluster: ClusterServer, etcd_server: EtcdServer, num_faults: int, seed: int) -> dict[str, Any]:
    """Inflict ``num_faults`` faults of a seeded random schedule, each on a random engine with work in
    flight once the previous one healed."""
    rng = random.Random(seed)
    schedule = _schedule(rng, num_faults)
    heal_s: dict[str, list[float]] = {kind: [] for kind in FAULTS}
    for kind in schedule:
        time.sleep(rng.uniform(0.5, 1.5))  # the schedule's spacing: streams run meanwhile
        healthy = wait_until(lambda: len(h := _healthy(cluster)) == 3 and h, 120, "3 healthy engines")
        busy = sorted(n for n, i in healthy.items() if i["num_inflight"]) or sorted(healthy)
        heal_s[kind].append(_fault(cluster, etcd_server, kind, healthy[rng.choice(busy)]))
    return {"schedule": schedule, "heal_s": heal_s}


def _chaos_run(
    cluster: ClusterServer, etcd_server: EtcdServer, num_prompts: int, num_faults: int, seed: int
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
        report = _chaos(cluster, etcd_server, num_faults, seed)
    finally:
        done.set()
        [w.join(GUARD_S) for w in workers]
    assert mismatches == []  # every request completed, token-identical to the no-fault run

    wait_until(lambda: len(_healthy(cluster)) == 3, 120, "the cluster to heal to 3 healthy engines")
    restarts = _restarts(cluster) - restarts_before
    migrations = cluster.admin()["num_migrations"] - migrations_before
    kills = report["schedule"].count("kill")
    assert restarts == kills and migrations > 0  # a stopped engine rejoined: no relaunch
    print(
        json.dumps(
            {
                "requests": completed[0],
                "schedule": report["schedule"],
                "restarts": restarts,
                "migrations": migrations,
                "time_to_heal_s": {
                    kind: {"median": round(sorted(t)[len(t) // 2], 2), "max": round(max(t), 2)}
                    for kind, t in report["heal_s"].items()
                    if t
                },
                "duration_s": round(time.monotonic() - started, 1),
                "lease_ttl_s": TTL_S,
            }
        )
    )


def test_chaos_short(cluster: ClusterServer, etcd: EtcdServer) -> None:
    _chaos_run(cluster, etcd, num_prompts=24, num_faults=3, seed=1)


@pytest.mark.slow
def test_chaos_soak(cluster: ClusterServer, etcd: EtcdServer) -> None:
    _chaos_run(cluster, etcd, num_prompts=48, num_faults=12, seed=2)
