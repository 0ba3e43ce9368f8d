"""A stalled engine rejoins as a new incarnation; a silent one is fenced off in the store too.

End to end (attach mode: real etcd, two standalone ``xllm engine`` processes, a service with
``cluster.launcher: external``, so nothing is supervised or relaunched): greedy streams run on both
engines, one engine is frozen with ``SIGSTOP`` until its lease is gone from etcd (the service
declared it dead and migrated its streams), then resumed with ``SIGCONT``. Its streams finish
identical to a no-fault run; the same process comes back as a new incarnation, drops what its fenced
incarnation still ran, and the service routes to it again: the cluster is back to two engines. The
time from ``SIGCONT`` to routed is printed as one JSON line.

Then the two halves without processes, against the same etcd: an agent whose lease ended registers
a new incarnation only after the engine dropped the old one's requests, and a registry that sees no
heartbeat revokes the silent instance's lease (the one its record names), so an engine that was only
stalled learns it was fenced off even where its lease would have outlived the gap.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tests.xservice.cluster.helpers import EtcdServer
from tests.xservice.cluster.test_cluster_restart import (  # noqa: F401 - the engines fixture
    Service,
    _keys,
    complete,
    engines,
    wait_until,
)
from xengine.api.cluster import keys
from xengine.api.messages import EngineStats

PROMPTS = [f"Story {i}: once upon a time in a land far away there lived a" for i in range(4)]
MAX_TOKENS = 300  # the frozen engine's streams are still running when it stops
GUARD_S = 120.0  # a broken build must not hang the suite; not a timing assertion


def _streams(service: Service, during: Any = None) -> list[tuple[str, str | None]]:
    client = service.openai()
    out: dict[int, list[str]] = {i: [] for i in range(len(PROMPTS))}
    finish: dict[int, Any] = {}

    def run(i: int) -> None:
        try:
            for chunk in complete(client, PROMPTS[i], MAX_TOKENS, stream=True):
                out[i].append(chunk.choices[0].text)
                finish[i] = chunk.choices[0].finish_reason or finish.get(i)
        except Exception as e:  # noqa: BLE001 - reported by the comparison
            finish[i] = repr(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    [t.start() for t in threads]
    if during is not None:
        wait_until(lambda: all(len(c) >= 3 for c in out.values()), 60, "every stream to start")
        during()
    [t.join(GUARD_S) for t in threads]
    return [("".join(out[i]), finish.get(i)) for i in range(len(PROMPTS))]


def _engine_log(logs: list[Path], name: str) -> str:
    return logs[int(name.rsplit("-", 1)[1])].read_text()


def test_a_stalled_engine_rejoins_as_a_new_incarnation(
    engines: tuple[Path, list[Path]],  # noqa: F811
    etcd: EtcdServer,
    tmp_path: Path,
) -> None:
    config, logs = engines
    service = Service(config, tmp_path / "service.log")
    try:
        expected = _streams(service)
        assert [f for _, f in expected] == ["length"] * len(PROMPTS)
        migrations = service.http.get("/v1/admin/instances").json()["num_migrations"]
        victim: dict[str, Any] = {}
        resumed: dict[str, float] = {}

        def stall() -> None:
            victim.update(max(service.instances().values(), key=lambda i: i["num_inflight"]))
            assert victim["num_inflight"] > 0
            os.kill(victim["pid"], signal.SIGSTOP)
            try:  # longer than the lease: etcd dropped its key, the service failed its streams over
                wait_until(lambda: victim["name"] not in _keys(etcd, "instances"), 60, "the lease to end")
                wait_until(
                    lambda: not service.instances().get(victim["name"], {}).get("healthy"), 60, "fencing"
                )
            finally:
                os.kill(victim["pid"], signal.SIGCONT)
                resumed["at"] = time.monotonic()

        faulty = _streams(service, stall)
        assert faulty == expected  # every stream token-identical to the no-fault run

        def routed_again() -> dict[str, Any] | None:
            i = service.instances().get(victim["name"])
            return i if i and i["healthy"] and i["incarnation"] != victim["incarnation"] else None

        back = wait_until(routed_again, GUARD_S, f"{victim['name']} to be routed again")
        rejoin_s = time.monotonic() - resumed["at"]
        assert back["pid"] == victim["pid"]  # the same process, re-admitted (attach mode relaunches nothing)
        assert [i["healthy"] for i in service.instances().values()] == [True, True]
        assert service.http.get("/health").status_code == 200
        registered = keys.decode(_keys(etcd, "instances")[victim["name"]], keys.InstanceRecord)
        assert registered.incarnation == back["incarnation"] and registered.lease
        view = service.http.get("/v1/admin/instances").json()
        assert view["num_migrations"] > migrations

        # what the fenced incarnation still ran was dropped, not run to its end
        log = _engine_log(logs, victim["name"])
        assert "fenced off: dropping" in log and "fenced off: dropping 0 request" not in log
        wait_until(
            lambda: (service.instances()[victim["name"]]["load"] or {"num_running": 1})["num_running"] == 0,
            30,
            "the old incarnation's requests to be gone",
        )

        # it serves: concurrent requests spread over both engines again
        routed = back["num_routed"]
        client = service.openai()
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda p: complete(client, p, 8), PROMPTS))
        assert [o.choices[0].text for o in outs] == [
            t[: len(o.choices[0].text)] for (t, _), o in zip(expected, outs)
        ]
        assert all(o.choices[0].finish_reason == "length" for o in outs)
        assert service.instances()[victim["name"]]["num_routed"] > routed
        print(json.dumps({"sigcont_to_routed_s": round(rejoin_s, 2), "lease_ttl_s": 3.0, "heartbeat_s": 0.5}))
    finally:
        service.stop()


def _record(name: str, incarnation: str) -> keys.InstanceRecord:
    return keys.InstanceRecord(
        name=name, role="mixed", incarnation=incarnation, input_addr="tcp://127.0.0.1:1",
        output_addr="tcp://127.0.0.1:2", pid=os.getpid(), info={}, started_at=0.0,
    )  # fmt: skip


def test_an_agent_whose_lease_ended_registers_a_new_incarnation_after_the_fence(
    etcd: EtcdServer,
) -> None:
    from xengine.api.cluster.store.etcd import EtcdStore
    from xengine.process.cluster_agent import ClusterAgent

    async def main() -> None:
        store = EtcdStore("127.0.0.1", etcd.port)
        prefix = f"/fenced-{time.monotonic_ns()}"
        agent = ClusterAgent(etcd.endpoint, prefix, _record("e0", "inc-1"), EngineStats)
        fenced: list[str | None] = []

        async def registered() -> str | None:
            raw = await store.get(f"{prefix}/instances/e0")
            return keys.decode(raw, keys.InstanceRecord).incarnation if raw else None

        def fence(timeout_s: float) -> bool:  # what the engine loop sees: still the old registration
            fenced.append(asyncio.run_coroutine_threadsafe(registered(), loop).result(timeout_s))
            return True

        loop = asyncio.get_running_loop()
        agent.fence = fence
        await agent._beat(store)
        assert await registered() == "inc-1" and fenced == []
        await agent._beat(store)  # the lease lives: nothing changes
        assert await registered() == "inc-1" and agent.num_reincarnations == 0
        await store.revoke(agent._lease)  # the lease ends (a stall longer than it, or a service's verdict)
        await agent._beat(store)
        new = await registered()
        assert new not in (None, "inc-1") and new == agent.record.incarnation
        assert fenced == [None]  # the engine dropped the old requests before the new incarnation showed
        assert agent.num_reincarnations == 1
        raw = await store.get(f"{prefix}/instances/e0")
        assert keys.decode(raw, keys.InstanceRecord).lease == agent._lease
        await store.revoke(agent._lease)
        await store.close()

    asyncio.run(main())


def test_a_silent_instance_loses_its_lease_to_the_registry(etcd: EtcdServer) -> None:
    """The agent's lease (600 s) would outlive the registry's heartbeat gap (1.2 s): the registry
    revokes it when it declares the instance dead, and the agent's next beat comes back anew."""
    from xengine.api.cluster.store.etcd import EtcdStore
    from xengine.process.cluster_agent import ClusterAgent
    from xservice.cluster.registry import InstanceRegistry

    async def main() -> None:
        store = EtcdStore("127.0.0.1", etcd.port)
        prefix = f"/silent-{time.monotonic_ns()}"
        registry = InstanceRegistry(store, prefix, lease_ttl_s=1.0, heartbeat_interval_s=0.2)
        seen: list[tuple[str, str]] = []
        registry.subscribe(lambda event, state, _: seen.append((event, state.record.incarnation)))
        await registry.start()
        agent = ClusterAgent(etcd.endpoint, prefix, _record("e0", "inc-1"), EngineStats, lease_ttl_s=600.0)
        agent.fence = lambda timeout_s: True
        await agent._beat(store)
        deadline = time.monotonic() + GUARD_S  # (well within the agent's own lease)
        while ("down", "inc-1") not in seen or await store.get(f"{prefix}/instances/e0") is not None:
            assert time.monotonic() < deadline, "the silent instance was not fenced off in the store"
            await asyncio.sleep(0.05)
        assert await store.keepalive(agent._lease) is False  # its lease is gone, not only its key
        await agent._beat(store)
        new = agent.record.incarnation
        assert new != "inc-1"
        while ("up", new) not in seen:
            assert time.monotonic() < deadline, "the new incarnation did not come up"
            await asyncio.sleep(0.05)
        assert registry.instances["e0"].record.incarnation == new and registry.instances["e0"].healthy
        await store.revoke(agent._lease)
        await registry.close()
        await store.close()

    asyncio.run(main())
