"""``InstanceRegistry``: the service's live view of the cluster, fed by a watch on the store.

It keeps every registered instance (record, last load report, health), the global KV index,
and tells listeners when an instance comes up or goes down. An instance goes down when its key is
deleted (lease expired or revoked), when another incarnation registers under its name, or when
no heartbeat arrived for ``lease_ttl + heartbeat`` while the store is reachable. Records from
any other incarnation than the registered one are rejected (``num_stale_rejected``).

A heartbeat gap is made true in the store: the registry revokes the silent instance's lease (the
one its record names), so an engine that was only stalled finds its lease gone when it resumes and
comes back as a new incarnation (``xengine/process/cluster_agent.py``) instead of heartbeating on under an
incarnation the services count dead. Gaps the service caused itself (its event loop stalled, so it
read no heartbeat) do not count: a monitor tick that comes late moves every deadline by as much.

When the store is unreachable the view is kept as is (serving continues); once it is back the
registry re-reads a snapshot, gives every instance a fresh grace period to re-register, and
watches again. The KV index is persisted per instance under ``<prefix>/kv/<name>`` (batched),
so a restarted service rebuilds its routing state from the store: its first snapshot loads each
registered incarnation's persisted set, then applies the latest ``kv_events`` batch on top (and
deletes the snapshots of instances that are no longer registered).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from xengine.api.cluster import keys
from xengine.api.cluster.store import BaseMetadataStore, StoreUnavailableError, WatchEvent
from xservice.cluster.kv_index import GlobalKVIndex, TierKVIndex

logger = logging.getLogger(__name__)

PERSIST_INTERVAL_S = 1.0
MAX_BACKOFF_S = 2.0


@dataclass
class InstanceState:
    record: keys.InstanceRecord
    last_heartbeat: float  # time.monotonic() of the last sign of life seen through the store
    load: keys.LoadReport | None = None
    healthy: bool = True
    kv_seq: int = 0


Listener = Callable[[str, InstanceState, str], None]  # (event "up" | "down", state, reason)


class InstanceRegistry:
    def __init__(
        self,
        store: BaseMetadataStore,
        key_prefix: str = "/xllm",
        lease_ttl_s: float = 3.0,
        heartbeat_interval_s: float = 0.5,
        persist_kv: bool = True,
    ) -> None:
        self.store = store
        self.prefix = key_prefix.rstrip("/")
        self.lease_ttl_s = lease_ttl_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.persist_kv = persist_kv
        self.instances: dict[str, InstanceState] = {}
        self.kv_index = GlobalKVIndex()
        self.tier_index = TierKVIndex()  # what their KV tiers hold (docs/kv_tiers.md)
        self.num_stale_rejected = 0
        self.store_ok = False
        self._store_ok_since = 0.0
        self._revision = 0
        self._dirty_kv: set[str] = set()
        self._listeners: list[Listener] = []
        self.load_listeners: list[Callable[[str, keys.LoadReport], None]] = []  # every accepted report
        self._tasks: list[asyncio.Task] = []
        self._synced = asyncio.Event()

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    async def start(self, timeout_s: float = 10.0) -> None:
        """Start watching; waits (up to ``timeout_s``) for the first snapshot of the store."""
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._watch_loop()), loop.create_task(self._monitor_loop())]
        try:
            await asyncio.wait_for(self._synced.wait(), timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            raise StoreUnavailableError(f"metadata store not reachable within {timeout_s:.0f}s") from None

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.store_ok:
            try:
                await self._persist_dirty()
            except Exception:  # noqa: BLE001
                pass

    def incarnation_of(self, name: str) -> str | None:
        """The incarnation registered under ``name``, if any."""
        state = self.instances.get(name)
        return state.record.incarnation if state is not None else None

    @property
    def dead_after_s(self) -> float:
        return self.lease_ttl_s + self.heartbeat_interval_s

    # ------------------------------------------------------------------ watch

    async def _watch_loop(self) -> None:
        backoff = 0.1
        while True:
            try:
                await self._sync()
                backoff = 0.1
                async for event in self.store.watch_prefix(self.prefix + "/", self._revision + 1):
                    self._apply(event)
            except StoreUnavailableError as e:
                if self.store_ok:
                    logger.warning("metadata store unavailable (%s); serving on the last known view", e)
                self.store_ok = False
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    async def _sync(self) -> None:
        """Rebuild from a snapshot of the store; instances not in it get a grace period."""
        data, revision = await self.store.get_prefix(self.prefix + "/")
        now = time.monotonic()
        by_kind: dict[str, dict[str, bytes]] = {}
        for k, v in data.items():
            parsed = keys.parse_key(self.prefix, k)
            if parsed is not None:
                by_kind.setdefault(parsed[0], {})[parsed[1]] = v
        for name, raw in by_kind.get("instances", {}).items():
            self._apply_instance(name, raw, now)
        stale: list[str] = []
        for name, raw in by_kind.get("kv", {}).items():
            snap = keys.decode(raw, keys.KVSnapshot)
            state = self.instances.get(name)
            if snap is not None and state is not None and snap.incarnation == state.record.incarnation:
                if not self.kv_index.num_blocks(name):
                    self.kv_index.replace(name, snap.hashes)
            else:
                stale.append(name)  # an instance that died while no service watched it
        for kind in ("load", "kv_events"):
            for name, raw in by_kind.get(kind, {}).items():
                self._apply(WatchEvent("put", keys.key(self.prefix, kind, name), raw, revision))
        for state in self.instances.values():
            state.last_heartbeat = max(state.last_heartbeat, now)  # grace: a fresh chance to heartbeat
        if self.persist_kv:
            for name in stale:  # (a re-registering instance republishes its whole KV set anyway)
                await self._forget_kv(name)
        self._revision = revision
        self.store_ok, self._store_ok_since = True, now
        self._synced.set()

    def _apply(self, event: WatchEvent) -> None:
        self._revision = max(self._revision, event.revision)
        parsed = keys.parse_key(self.prefix, event.key)
        if parsed is None:
            return
        kind, name = parsed
        now = time.monotonic()
        if kind == "instances":
            if event.kind == "put":
                self._apply_instance(name, event.value, now)
            elif name in self.instances:
                self._down(name, "its lease expired or it deregistered")
        elif kind == "load" and event.kind == "put":
            report = keys.decode(event.value, keys.LoadReport)
            state = self._current(name, report)
            if state is not None:
                state.load, state.last_heartbeat = report, now
                self._revive(name, state)
                for listener in self.load_listeners:
                    listener(name, report)
        elif kind == "kv_events" and event.kind == "put":
            batch = keys.decode(event.value, keys.KVEventBatch)
            state = self._current(name, batch)
            if state is not None:
                self._apply_kv(name, state, batch)

    def _current(self, name: str, record: object | None) -> InstanceState | None:
        """The instance's state if ``record`` comes from its registered incarnation, else None."""
        state = self.instances.get(name)
        if (
            record is None
            or state is None
            or getattr(record, "incarnation", None) != state.record.incarnation
        ):
            self.num_stale_rejected += 1
            return None
        return state

    def _apply_instance(self, name: str, raw: bytes, now: float) -> None:
        record = keys.decode(raw, keys.InstanceRecord)
        if record is None or record.name != name:
            self.num_stale_rejected += 1
            return
        state = self.instances.get(name)
        if state is not None and state.record.incarnation == record.incarnation:
            state.last_heartbeat = now
            self._revive(name, state)
            return
        if state is not None:
            self._down(name, f"replaced by incarnation {record.incarnation}")
        self.instances[name] = state = InstanceState(record=record, last_heartbeat=now)
        logger.info("instance %s (%s) up at %s", name, record.role, record.input_addr)
        self._notify("up", state, "registered")

    def _apply_kv(self, name: str, state: InstanceState, batch: keys.KVEventBatch) -> None:
        if batch.seq <= state.kv_seq and not batch.full:
            return  # already applied (a re-read after a resync)
        state.kv_seq = batch.seq
        if batch.full:
            self.kv_index.replace(name, batch.stored)
        else:
            self.kv_index.remove(name, batch.removed)
            self.kv_index.add(name, batch.stored)
        self.tier_index.apply(name, batch.full, batch.tier_stored, batch.tier_removed)
        self._dirty_kv.add(name)

    def _revive(self, name: str, state: InstanceState) -> None:
        if not state.healthy:
            state.healthy = True
            logger.info("instance %s heartbeats again", name)
            self._notify("up", state, "heartbeats again")

    def _down(self, name: str, reason: str) -> None:
        state = self.instances.pop(name, None)
        if state is None:
            return
        logger.warning("instance %s down: %s", name, reason)
        self.kv_index.drop(name)
        self.tier_index.drop(name)
        self._dirty_kv.discard(name)
        if self.persist_kv:
            self._spawn(self._forget_kv(name))
        if state.healthy:
            state.healthy = False
            self._notify("down", state, reason)

    def _notify(self, event: str, state: InstanceState, reason: str) -> None:
        for listener in list(self._listeners):
            try:
                listener(event, state, reason)
            except Exception:  # noqa: BLE001 - one broken listener must not stop the registry
                logger.exception("registry listener failed")

    # ------------------------------------------------------------------ monitor

    async def _monitor_loop(self) -> None:
        last_persist = 0.0
        tick = self.heartbeat_interval_s / 2
        last_tick = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            stalled = now - last_tick - tick  # our own loop was this late: heartbeats may wait unread
            if stalled > self.heartbeat_interval_s:  # that long does not count against the instances
                for state in self.instances.values():
                    state.last_heartbeat = min(now, state.last_heartbeat + stalled)
            last_tick = now
            if self.store_ok and now - self._store_ok_since > self.dead_after_s:
                for name, state in list(self.instances.items()):
                    if state.healthy and now - state.last_heartbeat > self.dead_after_s:
                        state.healthy = False
                        logger.warning(
                            "instance %s: no heartbeat for %.1fs", name, now - state.last_heartbeat
                        )
                        self._notify("down", state, "heartbeat gap")
                        self._spawn(self._revoke(state.record))
            if self.persist_kv and self.store_ok and now - last_persist >= PERSIST_INTERVAL_S:
                last_persist = now
                try:
                    await self._persist_dirty()
                except StoreUnavailableError:
                    pass  # the watch loop notices and resyncs

    async def _persist_dirty(self) -> None:
        for name in list(self._dirty_kv):
            state = self.instances.get(name)
            self._dirty_kv.discard(name)
            if state is None:
                continue
            snap = keys.KVSnapshot(
                incarnation=state.record.incarnation, hashes=sorted(self.kv_index.hashes_of(name))
            )
            try:
                await self.store.put(keys.key(self.prefix, "kv", name), keys.encode(snap))
            except StoreUnavailableError:
                self._dirty_kv.add(name)
                raise

    def _spawn(self, coro: Any) -> None:
        self._tasks = [t for t in self._tasks if not t.done()]
        self._tasks.append(asyncio.get_running_loop().create_task(coro))

    async def _revoke(self, record: keys.InstanceRecord) -> None:
        """End the lease of an incarnation declared dead (its keys go; the engine, if only stalled,
        re-registers as a new incarnation)."""
        if not record.lease:
            return
        try:
            await self.store.revoke(record.lease)
            logger.info("revoked the lease of %s (incarnation %s)", record.name, record.incarnation)
        except Exception as e:  # noqa: BLE001 - expired already, or the store is away: it ends anyway
            logger.debug("revoking the lease of %s failed: %s", record.name, e)

    async def _forget_kv(self, name: str) -> None:
        try:
            if name not in self.instances:
                await self.store.delete(keys.key(self.prefix, "kv", name))
        except StoreUnavailableError:
            pass
