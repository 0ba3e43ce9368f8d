"""The engine side of cluster mode: registration under a lease, heartbeats with load, KV events.

``ClusterAgent`` runs in a daemon thread with its own asyncio loop, so the engine loop never waits on
the metadata store. Each heartbeat keeps the lease alive and writes the ``LoadReport`` (with the raw
prefill and step samples the engine thread observed) and, when the prefix cache changed, a
``KVEventBatch``. Registration is fenced: an instance key is never taken over from another live
incarnation. A lease that ended while registered means the cluster failed this incarnation's
requests over: the agent has the engine loop drop them (``fence``) and comes back as a new
incarnation. See ``docs/cluster.md``. The store clients (``xengine.api.cluster.store``) are imported
lazily.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from xengine.api.security import ClusterKey

logger = logging.getLogger("xengine.process.cluster_agent")

MAX_BACKOFF_S = 5.0
FULL_KV_EVERY_S = 20.0  # republish the whole KV set now and then, healing any lost batch
MAX_TIER_HASHES = 1 << 16  # per KV tier, the newest hashes an instance reports (an etcd value stays small)
EWMA_ALPHA = 0.2
MAX_PENDING_SAMPLES = 4096  # per kind, while reports cannot be sent (the oldest go first)
FENCE_TIMEOUT_S = 30.0  # how long the engine loop may take to drop a fenced incarnation's requests


class RegistrationConflictError(RuntimeError):
    """Another live incarnation holds this instance name."""


class FenceTimeoutError(RuntimeError):
    """The engine loop did not drop the fenced incarnation's requests in time (retried)."""


class ClusterAgent:
    def __init__(
        self,
        store_url: str,
        key_prefix: str,
        record: Any,  # xengine.api.cluster.keys.InstanceRecord
        load_fn: Callable[[], Any],  # -> EngineStats
        lease_ttl_s: float = 3.0,
        heartbeat_interval_s: float = 0.5,
        key: ClusterKey | None = None,  # authenticates to a service's embedded store
        replaces: str | None = None,  # the dead incarnation of this name it may take the name over from
    ) -> None:
        self.store_url = store_url
        self.replaces = replaces
        self.key_prefix = key_prefix
        self.record = record
        self.lease_ttl_s = lease_ttl_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self._key = key
        self._load_fn = load_fn
        self._events: collections.deque[tuple[list[int], list[int]]] = collections.deque()
        self._hashes: set[int] = set()
        # KV tiers: (tier, stored, removed) from the tier worker's thread; what each tier holds
        self._tier_events: collections.deque[tuple[str, list[int], list[int]]] = collections.deque()
        self._tier_hashes: dict[str, dict[int, None]] = {}
        self.prefill_token_ms: float | None = None
        # raw performance samples (``keys.LoadReport.prefills`` / ``steps``): appended by the engine
        # thread, drained by this agent's (deque append / popleft are atomic)
        self._prefills: collections.deque[list[float]] = collections.deque(maxlen=MAX_PENDING_SAMPLES)
        self._steps: collections.deque[list[float]] = collections.deque(maxlen=MAX_PENDING_SAMPLES)
        self._need_full = True
        self._last_full = 0.0
        self._kv_seq = 0
        self._load_seq = 0
        self._lease: int | None = None
        self._registered: str | None = None  # the incarnation that last registered successfully
        self._previous: set[str] = set()  # this process's earlier (fenced) incarnations
        self._fence_due = False  # a new incarnation whose predecessor's requests may still run
        # (engine server) drops every request of the current incarnation, True once done; called in
        # the agent thread, blocks up to its argument in seconds
        self.fence: Callable[[float], bool] | None = None
        self.num_reincarnations = 0
        self.ttft_ms: float | None = None
        self.tpot_ms: float | None = None
        self.num_registrations = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, daemon=True, name="cluster-agent")

    # ------------------------------------------------------------------ engine-thread API

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 3.0) -> None:
        """Stop heartbeating and revoke the lease (the instance leaves the registry at once)."""
        self._stop.set()
        self._thread.join(timeout_s)

    def on_kv_events(self, stored: list[int], removed: list[int]) -> None:
        """Prefix-cache event sink (called in the engine thread; O(1))."""
        self._events.append((stored, removed))

    def on_tier_events(self, tier: str, stored: list[int], removed: list[int]) -> None:
        """KV tier event sink (``xengine/tiered_kv.py``; called on the tier worker's thread; O(1))."""
        self._tier_events.append((tier, stored, removed))

    def observe_ttft(self, ms: float) -> None:
        self.ttft_ms = ms if self.ttft_ms is None else (1 - EWMA_ALPHA) * self.ttft_ms + EWMA_ALPHA * ms

    def observe_tpot(self, ms: float) -> None:
        self.tpot_ms = ms if self.tpot_ms is None else (1 - EWMA_ALPHA) * self.tpot_ms + EWMA_ALPHA * ms

    def observe_prefill(self, uncached_tokens: int, queue_s: float, compute_s: float) -> None:
        """A request's first token came (engine thread; O(1)): one ``LoadReport.prefills`` sample."""
        self._prefills.append([uncached_tokens, queue_s, compute_s])
        if uncached_tokens > 0:
            ms = 1000 * compute_s / uncached_tokens
            old = self.prefill_token_ms
            self.prefill_token_ms = ms if old is None else (1 - EWMA_ALPHA) * old + EWMA_ALPHA * ms

    def observe_step(self, num_seqs: int, context_tokens: int, prefill_tokens: int, step_s: float) -> None:
        """A non-empty step ran (engine thread; O(1)): one ``LoadReport.steps`` sample."""
        self._steps.append([num_seqs, context_tokens, prefill_tokens, step_s])

    # ------------------------------------------------------------------ agent thread

    def _thread_main(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        from xengine.api.cluster.store import open_store

        store = open_store(self.store_url, self._key)
        backoff = self.heartbeat_interval_s
        failing = False
        try:
            while not self._stop.is_set():
                try:
                    await self._beat(store)
                    if failing:
                        logger.info("metadata store reachable again")
                    failing, backoff = False, self.heartbeat_interval_s
                except Exception as e:  # noqa: BLE001 - keep serving; retry with backoff
                    if not failing:
                        logger.warning("cluster heartbeat failed (%s: %s); retrying", type(e).__name__, e)
                    failing, self._need_full = True, True
                    # never wait longer than a third of the lease: a store that comes back (etcd
                    # restores leases with a fresh TTL) keeps this incarnation's lease alive
                    backoff = min(
                        backoff * 2, MAX_BACKOFF_S, max(self.heartbeat_interval_s, self.lease_ttl_s / 3)
                    )
                    await self._sleep(backoff)
                    continue
                await self._sleep(self.heartbeat_interval_s)
            await self._leave(store)
        finally:
            await store.close()

    async def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self._stop.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(min(0.05, seconds))

    async def _beat(self, store: Any) -> None:
        if self._lease is None or not await store.keepalive(self._lease):
            if self._registered == self.record.incarnation:  # our lease ended: counted dead, failed over
                self._reincarnate()
            if self._fence_due:
                await self._fence()
            await self._register(store)
        await self._publish_load(store)
        await self._publish_kv(store)

    def _reincarnate(self) -> None:
        old = self.record.incarnation
        self._previous.add(old)
        self.record = msgspec.structs.replace(self.record, incarnation=uuid.uuid4().hex, lease=0)
        self._fence_due = True
        self.num_reincarnations += 1
        logger.warning(
            "lease of incarnation %s ended: the cluster fenced it off; coming back as incarnation %s",
            old, self.record.incarnation,
        )  # fmt: skip

    async def _fence(self) -> None:
        """Have the engine drop the previous incarnation's requests before the new one registers."""
        if self.fence is not None and not await asyncio.to_thread(self.fence, FENCE_TIMEOUT_S):
            raise FenceTimeoutError(
                f"the engine loop did not drop the fenced requests in {FENCE_TIMEOUT_S:.0f}s"
            )
        self._fence_due = False

    async def _register(self, store: Any) -> None:
        from xengine.api.cluster import keys

        self._lease = None
        lease = await store.grant_lease(self.lease_ttl_s)
        self.record = msgspec.structs.replace(self.record, lease=lease)
        k = keys.key(self.key_prefix, "instances", self.record.name)
        value = keys.encode(self.record)
        if not await store.create(k, value, lease):
            existing = keys.decode(await store.get(k) or b"", keys.InstanceRecord)
            held_by = existing.incarnation if existing is not None else None
            if held_by not in (None, self.record.incarnation, self.replaces, *self._previous):
                await store.revoke(lease)
                raise RegistrationConflictError(
                    f"instance name {self.record.name!r} is held by incarnation {held_by}"
                )
            if held_by is not None and held_by == self.replaces:  # its process exited: no lease wait
                logger.info("took the name %s over from dead incarnation %s", self.record.name, held_by)
            await store.put(k, value, lease)  # our own key from an older lease, or the dead one's
        self._lease = lease
        self._registered = self.record.incarnation
        self._need_full = True
        self.num_registrations += 1
        logger.info("registered %s (%s) lease %x", self.record.name, self.record.role, lease)

    async def _publish_load(self, store: Any) -> None:
        from xengine.api.cluster import keys

        stats = self._load_fn()
        self._load_seq += 1
        report = keys.LoadReport(
            incarnation=self.record.incarnation,
            seq=self._load_seq,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            kv_usage=stats.kv_usage,
            num_free_blocks=stats.num_free_blocks,
            num_cached_blocks=len(self._hashes),
            ttft_ms=self.ttft_ms,
            tpot_ms=self.tpot_ms,
            sent_at=time.time(),
            prefills=_take_samples(self._prefills, keys.MAX_SAMPLES),
            steps=_take_samples(self._steps, keys.MAX_SAMPLES),
            tier_block_load_ms=_tier_load_ms(stats),
            prefill_token_ms=self.prefill_token_ms,
            lora_adapters=list(stats.lora.slot_adapters) if stats.lora is not None else [],
        )
        await store.put(keys.key(self.key_prefix, "load", self.record.name), keys.encode(report), self._lease)

    def _drain_events(self) -> dict[int, bool]:
        final: dict[int, bool] = {}
        while True:
            try:
                stored, removed = self._events.popleft()
            except IndexError:
                return final
            for h in removed:
                final[h] = False
            for h in stored:
                final[h] = True

    def _drain_tier_events(self) -> dict[str, dict[int, bool]]:
        """Per tier, each hash's latest change since the last drain, applied to the tier's set (the
        newest ``MAX_TIER_HASHES`` of each are kept: the store is told no removals)."""
        final: dict[str, dict[int, bool]] = {}
        while self._tier_events:
            tier, stored, removed = self._tier_events.popleft()
            changes = final.setdefault(tier, {})
            held = self._tier_hashes.setdefault(tier, {})
            for h in removed:
                changes[h] = False
                held.pop(h, None)
            for h in stored:
                changes[h] = True
                held.pop(h, None)
                held[h] = None
            while len(held) > MAX_TIER_HASHES:
                held.pop(next(iter(held)))
        return final

    async def _publish_kv(self, store: Any) -> None:
        from xengine.api.cluster import keys

        changes = self._drain_events()
        for h, present in changes.items():
            (self._hashes.add if present else self._hashes.discard)(h)
        tiers = self._drain_tier_events()
        now = time.monotonic()
        full = self._need_full or ((changes or tiers) and now - self._last_full > FULL_KV_EVERY_S)
        if not full and not changes and not tiers:
            return
        self._kv_seq += 1
        if full:
            batch = keys.KVEventBatch(
                incarnation=self.record.incarnation,
                seq=self._kv_seq,
                full=True,
                stored=sorted(self._hashes),
                tier_stored={t: list(held) for t, held in self._tier_hashes.items()},
            )
        else:
            batch = keys.KVEventBatch(
                incarnation=self.record.incarnation,
                seq=self._kv_seq,
                stored=[h for h, p in changes.items() if p],
                removed=[h for h, p in changes.items() if not p],
                tier_stored={t: [h for h, p in c.items() if p] for t, c in tiers.items()},
                tier_removed={t: [h for h, p in c.items() if not p] for t, c in tiers.items()},
            )
        self._need_full = True  # until this batch is known to have landed
        await store.put(
            keys.key(self.key_prefix, "kv_events", self.record.name), keys.encode(batch), self._lease
        )
        self._need_full = False
        if full:
            self._last_full = now

    async def _leave(self, store: Any) -> None:
        if self._lease is None:
            return
        try:
            await store.revoke(self._lease)
        except Exception:  # noqa: BLE001 - the lease expires on its own
            logger.debug("lease revoke failed", exc_info=True)


def _tier_load_ms(stats: Any) -> dict[str, float]:
    """Mean milliseconds per block loaded from each KV tier so far (tiers with loads only)."""
    tiers = getattr(stats, "kv_tiers", None)
    if tiers is None:
        return {}
    return {t.name: 1000 * t.load_s / t.hits for t in tiers.tiers if t.hits}


def _take_samples(pending: collections.deque[list[float]], limit: int) -> list[list[float]]:
    """Every pending sample, or an even subsample of ``limit`` of them (all of the interval, not only
    its end, stays represented)."""
    taken = [pending.popleft() for _ in range(len(pending))]  # only this thread pops: never empty
    if len(taken) <= limit:
        return taken
    return [taken[i * len(taken) // limit] for i in range(limit)]
