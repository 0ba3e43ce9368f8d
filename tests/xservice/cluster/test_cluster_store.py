"""Metadata stores (embedded, and a real etcd 3.4 server), the KV block hash, the global index,
the registry's incarnation checks and the agent's registration fencing (the etcd server:
``helpers.EtcdServer``).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.xservice.cluster.helpers import EtcdServer
from xengine.api.cluster import keys
from xengine.api.cluster.store import BaseMetadataStore
from xservice.cluster.kv_index import GlobalKVIndex, block_hash, prompt_block_hashes
from xservice.cluster.registry import InstanceRegistry
from xservice.cluster.store.embedded import EmbeddedStore

GUARD_S = 30.0  # a broken store must not hang the suite; not a timing assertion


async def _until(cond, what: str) -> None:
    """Poll ``cond()`` until it holds (the state a step waits for), failing after ``GUARD_S``."""
    deadline = time.monotonic() + GUARD_S
    while not await cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def _stores(etcd: EtcdServer) -> list[BaseMetadataStore]:
    from xengine.api.cluster.store.etcd import EtcdStore

    return [EmbeddedStore(), EtcdStore("127.0.0.1", etcd.port)]


@pytest.mark.parametrize("kind", ["embedded", "etcd"])
def test_store_semantics_puts_leases_and_watch(etcd: EtcdServer, kind: str) -> None:
    async def main() -> None:
        store = _stores(etcd)[0 if kind == "embedded" else 1]
        p = f"/t-{kind}-{time.monotonic_ns()}"
        try:
            _, rev0 = await store.get_prefix(p + "/")
            events = []

            async def watch() -> None:
                async for ev in store.watch_prefix(p + "/", rev0 + 1):
                    events.append((ev.kind, ev.key.removeprefix(p), ev.value))

            watcher = asyncio.create_task(watch())  # from rev0 + 1: it misses nothing put from here
            lease = await store.grant_lease(1.0)
            await store.put(p + "/a", b"1", lease)
            assert await store.create(p + "/b", b"2")
            assert not await store.create(p + "/b", b"3")
            assert await store.get(p + "/b") == b"2"
            data, _ = await store.get_prefix(p + "/")
            assert data == {p + "/a": b"1", p + "/b": b"2"}
            assert await store.keepalive(lease)

            async def expired() -> bool:  # the lease (1 s) expires without keepalives
                return await store.get(p + "/a") is None

            await _until(expired, "the lease to expire")
            assert not await store.keepalive(lease)
            assert await store.get(p + "/b") == b"2"  # a key without a lease stays
            assert await store.delete(p + "/b")

            async def all_seen() -> bool:
                return len(events) >= 4

            await _until(all_seen, "the watch events")
            watcher.cancel()
            assert events == [
                ("put", "/a", b"1"),
                ("put", "/b", b"2"),
                ("delete", "/a", b""),
                ("delete", "/b", b""),
            ]
        finally:
            await store.close()

    asyncio.run(main())


def test_block_hash_is_pinned_and_chains_full_blocks_only() -> None:
    """Block hashes outlive processes: engines publish them, the store keeps each instance's index and
    a restarted (or upgraded) service reloads it. So their values are pinned: a change of the hash
    would make every persisted index silently match nothing."""
    tokens = list(range(100, 148))
    hashes = prompt_block_hashes(tokens + [1, 2], 16)  # the trailing partial block has no hash
    assert hashes == [0xD5D6602EA79C3F1E, 0xE030AF49AE52DF63, 0x5B7ECCD994A256E4]
    assert hashes[1] == block_hash(hashes[0], tokens[16:32])
    assert prompt_block_hashes(tokens[:32] + [0] * 16, 16)[:2] == hashes[:2]  # later blocks change nothing
    changed = prompt_block_hashes([9] + tokens[1:], 16)
    assert all(a != b for a, b in zip(changed, hashes, strict=True))  # the chain carries the prefix


def test_radix_cache_emits_stored_and_removed_hashes() -> None:
    from memory.block_pool import BlockPool
    from memory.prefix_cache.radix import RadixPrefixCache

    pool = BlockPool(8)
    cache = RadixPrefixCache(pool, 4)
    events: list[tuple[list[int], list[int]]] = []
    cache.event_sink = lambda stored, removed: events.append((stored, removed))
    tokens = list(range(12))
    blocks = pool.allocate(3)
    cache.insert(tokens, blocks)
    assert events == [(prompt_block_hashes(tokens, 4), [])]
    cache.evict(blocks[1])  # drops block 1 and its child (block 2)
    assert sorted(events[1][1]) == sorted(prompt_block_hashes(tokens, 4)[1:])


def test_global_index_matches_leading_blocks_per_instance() -> None:
    index = GlobalKVIndex()
    index.add("a", [1, 2, 3])
    index.add("b", [1, 2])
    assert index.match([1, 2, 3, 4]) == {"a": 3, "b": 2}
    index.remove("a", [1])
    assert index.match([1, 2, 3]) == {"b": 2}
    index.drop("b")
    assert index.match([1, 2]) == {}


def _record(name: str, incarnation: str) -> keys.InstanceRecord:
    return keys.InstanceRecord(
        name=name, role="mixed", incarnation=incarnation, input_addr="tcp://127.0.0.1:1",
        output_addr="tcp://127.0.0.1:2", pid=1, info={}, started_at=0.0,
    )  # fmt: skip


def test_registry_rejects_stale_incarnations_and_drops_expired_instances() -> None:
    async def main() -> None:
        store = EmbeddedStore()
        registry = InstanceRegistry(store, "/x", lease_ttl_s=1.0, heartbeat_interval_s=0.2, persist_kv=False)
        seen: list[tuple[str, str, str]] = []
        registry.subscribe(lambda ev, st, _r: seen.append((ev, st.record.name, st.record.incarnation)))
        await registry.start()
        lease = await store.grant_lease(1.0)
        await store.put("/x/instances/e0", keys.encode(_record("e0", "new")), lease)
        await store.put(
            "/x/load/e0", keys.encode(keys.LoadReport(incarnation="new", seq=1, num_running=2)), lease
        )
        old = keys.LoadReport(incarnation="old", seq=9, num_running=7)
        await store.put("/x/load/e0", keys.encode(old), lease)
        batch = keys.KVEventBatch(incarnation="old", seq=1, full=True, stored=[5, 6])
        await store.put("/x/kv_events/e0", keys.encode(batch), lease)

        async def both_stale_seen() -> bool:  # the watch delivers in order: all before them too
            return registry.num_stale_rejected >= 2

        await _until(both_stale_seen, "the stale records")
        state = registry.instances["e0"]
        assert state.load is not None and state.load.num_running == 2  # the stale report was ignored
        assert registry.kv_index.num_blocks("e0") == 0
        assert registry.num_stale_rejected == 2
        good = keys.KVEventBatch(incarnation="new", seq=1, full=True, stored=[5, 6])
        await store.put("/x/kv_events/e0", keys.encode(good), lease)

        async def indexed() -> bool:
            return registry.kv_index.match([5, 6]) == {"e0": 2}

        async def gone() -> bool:  # no keepalive: the lease expires, the instance goes down
            return "e0" not in registry.instances

        await _until(indexed, "the current incarnation's KV events")
        assert registry.num_stale_rejected == 2
        await _until(gone, "the expired instance to go down")
        assert registry.kv_index.num_blocks("e0") == 0
        assert seen == [("up", "e0", "new"), ("down", "e0", "new")]
        await registry.close()
        await store.close()

    asyncio.run(main())


def test_agent_registration_is_fenced_against_another_live_incarnation(etcd: EtcdServer) -> None:
    from xengine.api.cluster.store.etcd import EtcdStore
    from xengine.api.messages import EngineStats
    from xengine.process.cluster_agent import ClusterAgent, RegistrationConflictError

    async def main() -> None:
        store = EtcdStore("127.0.0.1", etcd.port)
        prefix = f"/fence-{time.monotonic_ns()}"
        first = ClusterAgent(etcd.endpoint, prefix, _record("e0", "inc-1"), EngineStats)
        second = ClusterAgent(etcd.endpoint, prefix, _record("e0", "inc-2"), EngineStats)
        await first._register(store)
        with pytest.raises(RegistrationConflictError):
            await second._register(store)
        raw = await store.get(f"{prefix}/instances/e0")
        assert keys.decode(raw, keys.InstanceRecord).incarnation == "inc-1"
        await first._register(store)  # the same incarnation may take its key over (new lease)
        await store.close()

    asyncio.run(main())


def test_a_relaunch_takes_the_name_over_from_the_dead_incarnation_it_replaces(etcd: EtcdServer) -> None:
    """The supervisor saw inc-1's process exit: inc-2 (``replaces="inc-1"``) registers at once, while
    inc-1's lease is still alive; a process naming another incarnation is still fenced off."""
    from xengine.api.cluster.store.etcd import EtcdStore
    from xengine.api.messages import EngineStats
    from xengine.process.cluster_agent import ClusterAgent, RegistrationConflictError

    async def main() -> None:
        store = EtcdStore("127.0.0.1", etcd.port)
        prefix = f"/takeover-{time.monotonic_ns()}"
        dead = ClusterAgent(etcd.endpoint, prefix, _record("e0", "inc-1"), EngineStats, lease_ttl_s=60.0)
        await dead._register(store)  # its lease outlives this test
        wrong = ClusterAgent(etcd.endpoint, prefix, _record("e0", "inc-x"), EngineStats, replaces="inc-0")
        with pytest.raises(RegistrationConflictError):
            await wrong._register(store)
        relaunch = ClusterAgent(etcd.endpoint, prefix, _record("e0", "inc-2"), EngineStats, replaces="inc-1")
        await relaunch._register(store)
        raw = await store.get(f"{prefix}/instances/e0")
        assert keys.decode(raw, keys.InstanceRecord).incarnation == "inc-2"
        await store.revoke(dead._lease)  # the dead lease ending takes nothing of the new incarnation's
        raw = await store.get(f"{prefix}/instances/e0")
        assert raw is not None and keys.decode(raw, keys.InstanceRecord).incarnation == "inc-2"
        await store.close()

    asyncio.run(main())
