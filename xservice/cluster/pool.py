"""``InstancePool``: the cluster's engine backend (``xservice/engine/protocol.py``) over every
registered instance.

``build_app`` gets a pool instead of one engine client. Per request the pool picks an instance
with the routing policy (over snapshots of load and of the global KV index), streams its deltas,
and keeps the request alive across instance failures: when the instance dies mid-stream the pool
re-submits the prompt plus the tokens already streamed to a healthy instance (recompute), with
``max_tokens`` / ``min_tokens`` reduced by what was generated, and keeps yielding deltas under the
original request id, so the client sees one uninterrupted stream with no token lost or repeated.

Migration covers ``n == 1`` requests (other requests fail with ``EngineDeadError`` as in single
node). It is exact for greedy decoding; sampled requests continue with a fresh random stream, and
frequency / presence penalties restart (the streamed tokens become prompt tokens).

Plain requests go to ``mixed`` instances (to ``decode``, then ``prefill`` ones when there is no
mixed one). When healthy ``prefill`` and ``decode`` instances exist, ``n == 1`` requests run PD
disaggregated through ``PDDispatcher`` (``xservice/cluster/pd.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import msgspec

from xengine.api.image_keys import cache_token_ids
from xengine.api.messages import AddRequest, CatalogInfo, CompletionDelta, EngineInfo, EngineStats
from xengine.api.security import ClusterKey
from xservice.cluster.colocation import Colocation
from xservice.cluster.continuation import continue_request
from xservice.cluster.dynamic_pd import DynamicPD
from xservice.cluster.eviction import Evictions
from xservice.cluster.kv_index import prompt_block_hashes
from xservice.cluster.pd import PDDispatcher, empty_import_counts
from xservice.cluster.registry import InstanceRegistry, InstanceState
from xservice.cluster.remote_engine import RemoteEngineClient
from xservice.cluster.supervisor import InstanceSupervisor
from xservice.cluster.tier_route import tier_route
from xservice.engine.client import HANG_TIMEOUT_S
from xservice.engine.errors import EngineDeadError
from xservice.engine.stats_sum import sum_engine_stats
from xservice.policies import PLAIN_ROLES, BaseRoutingPolicy, InstanceSnapshot, PDPolicy, RouteRequest

logger = logging.getLogger(__name__)

# EPD roles as PD sees them (an encode_prefill instance prefills, an encode_decode one decodes; an
# encode instance is neither, so plain and PD requests never go there)
PD_ROLE_OF = {"encode_prefill": "prefill", "encode_decode": "decode"}
HANDSHAKE_ATTEMPTS = 60
HANDSHAKE_TIMEOUT_S = 0.5


class InstancePool:
    def __init__(
        self,
        registry: InstanceRegistry,
        policy: BaseRoutingPolicy,
        migrate: bool = True,
        pd_policy: PDPolicy | None = None,
        key: ClusterKey | None = None,
        dynamic: DynamicPD | None = None,
        colocation: Colocation | None = None,
    ) -> None:
        self.registry = registry
        self.policy = policy
        self.migrate = migrate
        self._active: dict[str, tuple[RemoteEngineClient, str]] = {}  # req_id -> (client, sub req_id)
        self.evictions = Evictions(self._active.get)  # service-initiated moves (co-location)
        self.pd: PDDispatcher = PDDispatcher(self, pd_policy or PDPolicy())  # EPD: serve.py sets its own
        self.dynamic = dynamic  # dynamic PD: roles are service-side and flip (``dynamic_pd.py``)
        if dynamic is not None:
            dynamic.attach(lambda: self.clients, lambda: [s.name for s in self.snapshots()])
            registry.load_listeners.append(dynamic.monitor.ingest)
        self.colocation = colocation  # online/offline co-location pools (``colocation.py``)
        if colocation is not None:
            colocation.attach(
                lambda n: self.role_of(n, self.clients[n]),
                lambda: [s.name for s in self.snapshots()],
                self.evictions,
            )
            registry.load_listeners.append(colocation.ingest)
            if dynamic is None:
                registry.load_listeners.append(colocation.monitor.ingest)
        # what PD dispatching tells about the work it sent (dynamic PD's, else co-location's)
        self.monitor = dynamic.monitor if dynamic is not None else colocation.monitor if colocation else None
        self.service_id = uuid.uuid4().hex  # sent to every instance in a Hello (see engine_server)
        self.key = key  # the cluster key every instance authenticates us with (None: auth off)
        self.supervisor: InstanceSupervisor | None = None  # relaunches launched instances (serve.py)
        self.epd_auto: dict[str, Any] = {"enabled": False}  # epd.strategy auto's choice (serve.py)
        self.prfaas: Any = None  # the PrfaaS cluster's router (``xservice/cluster/prfaas``; serve.py)
        self.hang_timeout_s = HANG_TIMEOUT_S
        self.instance_stats: dict[str, EngineStats] = {}  # per instance, as of the last ``stats()``
        self.clients: dict[str, RemoteEngineClient] = {}  # connected and answering
        self._pending: dict[str, RemoteEngineClient] = {}  # connected, handshake in progress
        self.num_routed: dict[str, int] = {}
        self.num_migrations = 0
        self.last_migration_s: float | None = None  # dead instance detected -> migrated request resent
        self._inflight: dict[str, int] = {}
        self._dead_at = time.monotonic()
        # incarnations known dead: never reconnected to (a fenced process that resumes comes back as
        # a new incarnation, having dropped the old one's requests: see xengine/process/cluster_agent.py)
        self._dead: set[str] = set()
        self._changed = asyncio.Event()
        self._closed = False
        registry.subscribe(self._on_registry_event)

    # ------------------------------------------------------------------ membership

    def _on_registry_event(self, event: str, state: InstanceState, reason: str) -> None:
        rec = state.record
        if event == "down":
            self.mark_dead(rec.name, reason, rec.incarnation)
        elif rec.incarnation not in self._dead and not self._closed:
            old = self.clients.get(rec.name)
            if old is not None and old.incarnation == rec.incarnation and old.is_alive:
                return
            if old is not None:
                self.mark_dead(rec.name, "replaced", old.incarnation)
            pending = self._pending.get(rec.name)
            if pending is not None and pending.incarnation == rec.incarnation:
                return
            client = self._pending[rec.name] = RemoteEngineClient.connect(rec, self.service_id, self.key)
            client.hang_timeout_s = self.hang_timeout_s
            asyncio.get_running_loop().create_task(self._handshake(client))

    async def _handshake(self, client: RemoteEngineClient) -> None:
        """Route to a new instance only once it answered: its replies then reach our sockets."""
        name = client.name
        for _ in range(HANDSHAKE_ATTEMPTS):
            if self._pending.get(name) is not client or self._closed:
                break
            if await client.ping(HANDSHAKE_TIMEOUT_S):
                if self._pending.get(name) is client:
                    del self._pending[name]
                    self.clients[name] = client
                    self._inflight.setdefault(name, 0)
                    self.num_routed.setdefault(name, 0)
                    if self.dynamic is not None:
                        self.dynamic.instance_joined(client)
                    if self.colocation is not None:
                        self.colocation.instance_joined(client)
                    self._changed.set()
                    return
                break
        else:
            logger.warning("instance %s registered but does not answer at %s", name, client.input_addr)
        if self._pending.get(name) is client:
            del self._pending[name]
        await client.close()

    def mark_dead(self, name: str, reason: str, incarnation: str | None = None) -> None:
        """Instance ``name`` (of ``incarnation``, or whichever we hold) is gone: fail over its requests."""
        pending = self._pending.get(name)
        if pending is not None and (incarnation is None or pending.incarnation == incarnation):
            del self._pending[name]  # its handshake closes it
        client = self.clients.get(name)
        if client is None or (incarnation is not None and client.incarnation != incarnation):
            if incarnation is not None:
                self._dead.add(incarnation)
            return
        self._dead.add(client.incarnation)
        del self.clients[name]
        self._dead_at = time.monotonic()
        logger.warning("instance %s is dead (%s); failing over its requests", name, reason)
        client.mark_dead(f"instance {name} died: {reason}")
        asyncio.get_running_loop().create_task(client.close())
        self._changed.set()

    async def wait_for(self, names: list[str], timeout_s: float) -> None:
        """Wait until every instance in ``names`` is connected."""
        deadline = time.monotonic() + timeout_s
        while not all(n in self.clients for n in names):
            if time.monotonic() > deadline:
                missing = [n for n in names if n not in self.clients]
                raise TimeoutError(f"instances not registered after {timeout_s:.0f}s: {', '.join(missing)}")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), 0.5)
            except (TimeoutError, asyncio.TimeoutError):
                pass

    async def wait_for_any(self, timeout_s: float) -> None:
        """Wait until at least one instance is connected."""
        deadline = time.monotonic() + timeout_s
        while not self.clients:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no instance registered after {timeout_s:.0f}s")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), 0.5)
            except (TimeoutError, asyncio.TimeoutError):
                pass

    # ------------------------------------------------------------------ routing

    def snapshots(self) -> list[InstanceSnapshot]:
        out = []
        for name, client in sorted(self.clients.items()):
            state = self.registry.instances.get(name)
            if not client.is_alive or state is None or not state.healthy:
                continue
            load = state.load
            out.append(
                InstanceSnapshot(
                    name=name,
                    role=self.role_of(name, client),
                    num_inflight=self._inflight.get(name, 0),
                    num_running=load.num_running if load else 0,
                    num_waiting=load.num_waiting if load else 0,
                    kv_usage=load.kv_usage if load else 0.0,
                    lora_adapters=frozenset(load.lora_adapters) if load else frozenset(),
                )
            )
        return out

    def role_of(self, name: str, client: RemoteEngineClient) -> str:
        """The instance's current role: its dynamic PD pool role, else the one it registered with (EPD
        roles as PD sees them)."""
        role = self.dynamic.role(name) if self.dynamic is not None else None
        return role or PD_ROLE_OF.get(client.record.role, client.record.role)

    def route(
        self,
        prompt_token_ids: list[int],
        prefer: Sequence[Sequence[str]] = PLAIN_ROLES,
        lora: str | None = None,
    ) -> RemoteEngineClient:
        """An instance of the first role group in ``prefer`` that has a healthy one (routing policy)."""
        snapshots = self.snapshots()
        candidates: list[InstanceSnapshot] = []
        for roles in prefer:
            candidates = [s for s in snapshots if s.role in roles]
            if candidates:
                break
        if not candidates:
            raise EngineDeadError("no healthy engine instance to serve the request")
        request = dataclasses.replace(self.route_request(prompt_token_ids), lora_name=lora)
        return self.clients[self.policy.select(request, candidates)]

    def route_request(self, prompt_token_ids: list[int]) -> RouteRequest:
        """The prompt's whole-block count and, per instance, how many leading blocks it holds
        (``prompt_token_ids`` as the prefix caches key them: ``cache_token_ids`` for image prompts)."""
        hashes = prompt_block_hashes(prompt_token_ids, self.info.block_size)
        matched = self.registry.kv_index.match(hashes)
        return tier_route(hashes, matched, self.clients, self.registry, self.info.block_size)

    @contextlib.contextmanager
    def track(
        self, req_id: str, client: RemoteEngineClient, sub_id: str, routed: bool = True
    ) -> Iterator[None]:
        """Count ``client``'s work on request ``req_id`` (sent there as ``sub_id``) while it runs
        (``routed``: also as one more request routed to it)."""
        name = client.name
        self._inflight[name] = self._inflight.get(name, 0) + 1
        if routed:
            self.num_routed[name] = self.num_routed.get(name, 0) + 1
        self._active[req_id] = (client, sub_id)
        try:
            yield
        finally:
            self._inflight[name] -= 1
            if self._active.get(req_id, (None, None))[1] == sub_id:
                del self._active[req_id]

    @property
    def info(self) -> EngineInfo:
        for client in self.clients.values():
            return client.info
        raise EngineDeadError("no engine instance registered yet")

    async def generate(self, req: AddRequest) -> AsyncIterator[CompletionDelta]:
        """Route ``req`` (PD when possible) and stream its deltas, migrating it on failure (``n == 1``)."""
        stream = self.pd.generate(req) if self.pd.applies(req) else self.stream(req, req, [])
        async for delta in stream:
            yield delta

    async def stream(
        self,
        req: AddRequest,
        sub: AddRequest,
        generated: list[int],
        prefer: Sequence[Sequence[str]] = PLAIN_ROLES,
        client: RemoteEngineClient | None = None,
        num_cached_tokens: int | None = None,
        observe: Callable[[str, CompletionDelta], None] | None = None,
    ) -> AsyncIterator[CompletionDelta]:
        """Stream ``sub`` (``req`` itself or its continuation after ``generated``) on ``client`` or a
        routed instance; when that instance dies, continue on another one (recompute).

        ``generated`` is extended with every token yielded; deltas carry ``req``'s id and prompt size
        (and ``num_cached_tokens`` when given). ``observe(instance name, delta)`` sees each delta.
        """
        migrated = False
        try:
            while True:
                lora, salt = sub.params.lora_name, sub.params.cache_salt
                client = client or self.route(
                    cache_token_ids(sub.prompt_token_ids, sub.images, lora, salt), prefer, lora
                )
                name, moved_to = client.name, None
                try:
                    with self.track(req.req_id, client, sub.req_id):
                        async for delta in client.generate(sub):
                            if delta.finish_reason == "abort" and self.evictions.pending(req.req_id):
                                moved_to = self.evictions.take(req.req_id)  # ours: not the client's
                                delta = msgspec.structs.replace(delta, finish_reason=None, stop_reason=None)
                            if migrated:
                                self.last_migration_s = time.monotonic() - self._dead_at
                                migrated = False
                            if sub is not req:
                                delta = self._as_original(delta, req, num_cached_tokens)
                            generated.extend(delta.new_token_ids)
                            if observe is not None:
                                observe(name, delta)
                            if moved_to is None or delta.new_token_ids:
                                yield delta
                    if moved_to is None:
                        return
                    tag = f"e{self.evictions.num_evicted}"
                except EngineDeadError:
                    if not self.migrate or req.params.n != 1 or self._closed:
                        raise
                    tag = f"m{self.num_migrations + 1}"
                sub = self.continuation(req, generated, tag)
                if sub is None:
                    yield CompletionDelta(req_id=req.req_id, finish_reason="length")
                    return
                if moved_to is not None:  # evicted: continue on its target (routed if that is gone)
                    client = self.clients.get(moved_to)
                    prefer = (("prefill",), *prefer)
                    continue
                self.num_migrations += 1
                client, migrated = None, True
                logger.info("migrating %s from %s after %d tokens", req.req_id, name, len(generated))
        finally:
            self.evictions.discard(req.req_id)

    continuation = staticmethod(continue_request)

    @staticmethod
    def _as_original(
        delta: CompletionDelta, req: AddRequest, num_cached_tokens: int | None = None
    ) -> CompletionDelta:
        n = len(req.prompt_token_ids)
        cached = delta.num_cached_tokens if num_cached_tokens is None else num_cached_tokens
        return msgspec.structs.replace(
            delta, req_id=req.req_id, num_prompt_tokens=n, num_cached_tokens=min(cached, n)
        )

    async def abort(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            active = self._active.get(req_id)
            if active is not None:
                await active[0].abort([active[1]])

    async def stats(self, timeout_s: float = 5.0) -> EngineStats:
        """Counters summed over the live instances (``kv_usage``: their mean)."""
        clients = [c for c in self.clients.values() if c.is_alive]
        if not clients:
            raise EngineDeadError("no engine instance alive")
        results = await asyncio.gather(*(c.stats(timeout_s) for c in clients), return_exceptions=True)
        self.instance_stats = {c.name: r for c, r in zip(clients, results) if isinstance(r, EngineStats)}
        stats = list(self.instance_stats.values())
        if not stats:
            raise EngineDeadError(f"no engine instance answered: {results[0]!r}")
        return sum_engine_stats(stats)

    async def ping(self, timeout_s: float = 2.0) -> bool:
        clients = [c for c in self.clients.values() if c.is_alive]
        return any(await asyncio.gather(*(c.ping(timeout_s) for c in clients))) if clients else False

    async def reset_prefix_cache(self, timeout_s: float = 5.0) -> bool:
        return all(await asyncio.gather(*(c.reset_prefix_cache(timeout_s) for c in self._alive())))

    async def register_catalog(
        self, name: str, items: list[list[int]], timeout_s: float = 60.0
    ) -> CatalogInfo:
        """Item catalogs live in one engine's memory: a cluster serves none (a 400 naming ``name``)."""
        raise ValueError(
            "invalid value for 'name': item catalogs (generative recommendation) are served by a "
            "single-node engine, not by a cluster"
        )

    async def list_catalogs(self, timeout_s: float = 5.0) -> list[CatalogInfo]:
        """None: a cluster serves no item catalogs (see ``register_catalog``)."""
        return []

    def _alive(self) -> list[RemoteEngineClient]:
        return [c for c in self.clients.values() if c.is_alive]

    async def load_lora(self, name: str, path: str, replace: bool = False, timeout_s: float = 120.0) -> None:
        """Every live instance registers the adapter (a decode instance needs it as much as a prefill one)."""
        await asyncio.gather(*(c.load_lora(name, path, replace, timeout_s) for c in self._alive()))

    async def unload_lora(self, name: str, timeout_s: float = 10.0) -> None:
        await asyncio.gather(*(c.unload_lora(name, timeout_s) for c in self._alive()))

    @property
    def is_alive(self) -> bool:
        return not self._closed and any(c.is_alive for c in self.clients.values())

    @property
    def health(self) -> str:
        """ "ok" (an instance can serve), "restarting" (none can, but one is being relaunched or is
        registered and connecting) or "failed"."""
        if self.is_alive:
            return "ok"
        sup = self.supervisor
        pending = bool(self._pending) or (sup is not None and bool(sup.restarting))
        if self._closed or not pending and sup is not None and set(sup.gave_up) >= set(sup.specs):
            return "failed"
        return "restarting"

    def restart_counts(self) -> dict[str, int]:
        return dict(self.supervisor.num_restarts) if self.supervisor is not None else {}

    def given_up(self) -> list[str]:
        return sorted(self.supervisor.gave_up) if self.supervisor is not None else []

    @property
    def num_inflight(self) -> int:
        return len(self._active)

    @property
    def pid(self) -> int:
        for client in self.clients.values():
            return client.pid
        return -1

    async def close(self, drain_timeout_s: float = 0.0) -> None:
        self._closed = True
        if self.dynamic is not None:
            await self.dynamic.close()
        for client in list(self.clients.values()) + list(self._pending.values()):
            await client.close()
        self.clients.clear()

    # ------------------------------------------------------------------ admin

    async def instances_view(self, timeout_s: float = 2.0) -> list[dict[str, Any]]:
        """One entry per registered instance: role, health, load, KV blocks, routing counters (the
        PrfaaS cluster's after the local ones, in pool ``prfaas``)."""
        out = []
        if self.prfaas is not None:
            remote = await self.prfaas.pool.instances_view(timeout_s)
            tail = [{**e, "pool": "prfaas"} for e in remote]
        else:
            tail = []
        for name, state in sorted(self.registry.instances.items()):
            client = self.clients.get(name)
            rec = state.record
            dynamic = self.dynamic.instance_view(name) if self.dynamic is not None else {}
            if self.colocation is not None:
                dynamic.update(self.colocation.instance_view(name))
            out.append(
                {
                    "name": name,
                    "role": rec.role,
                    "pool": None,
                    **dynamic,
                    "healthy": bool(state.healthy and client is not None and client.is_alive),
                    "incarnation": rec.incarnation,
                    "pid": rec.pid,
                    "address": rec.input_addr,
                    "output_address": rec.output_addr,
                    "load": msgspec.to_builtins(state.load) if state.load else None,
                    "heartbeat_age_s": round(time.monotonic() - state.last_heartbeat, 3),
                    "num_kv_blocks_indexed": self.registry.kv_index.num_blocks(name),
                    "kv_tier_blocks_indexed": self.registry.tier_index.counts(name),  # host, disk
                    "num_inflight": self._inflight.get(name, 0),
                    "num_routed": self.num_routed.get(name, 0),
                    "kv_imported": dict(self.pd.imported.get(name, empty_import_counts())),
                }
            )
        return out + tail

    def cluster_view(self) -> dict[str, Any]:
        return {
            "mode": "cluster",
            "routing_policy": self.policy.name,
            "store_ok": self.registry.store_ok,
            "num_migrations": self.num_migrations,
            "num_stale_rejected": self.registry.num_stale_rejected,
            "kv_store_blocks_indexed": len(self.registry.tier_index.store),  # written to the KV store
            "pd": dataclasses.asdict(self.pd.counters),
            "epd": self.pd.view() if hasattr(self.pd, "view") else {"strategy": "none"},
            "epd_auto": self.epd_auto,
            "dynamic_pd": self.dynamic.view() if self.dynamic is not None else {"enabled": False},
            "colocation": self.colocation.view() if self.colocation is not None else {"enabled": False},
            "prfaas": self.prfaas.view() if self.prfaas is not None else {"enabled": False},
        }
