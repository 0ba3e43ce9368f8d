"""``xllm serve`` in cluster mode: store, registry, launched instances and the pool behind the app.

Called by ``xservice.commands.serve`` when the config lists ``cluster.launch.instances`` (or sets
``cluster.launch.launcher: external``). The service opens the metadata store (etcd, or the embedded store
served to its engines over loopback ZMQ), starts the registry, launches the instances, waits until
each registered, then serves HTTP over an ``InstancePool``. A launched instance whose process exits
is failed over at once (its lease would expire later anyway) and relaunched by the
``InstanceSupervisor`` with backoff. Engines and the embedded store's bridge authenticate the
service with the cluster key (ZMQ CURVE; ``docs/security.md``).

With ``launcher: external`` (attach mode) it launches nothing: the instances are standalone
``xllm engine`` processes that registered in etcd and outlive the service. The registry's first
snapshot rebuilds the global prefix index from the persisted ``<prefix>/kv/*`` plus the latest
``<prefix>/kv_events/*`` before the first request is routed; the service then waits for the
instances listed in ``cluster.launch.instances`` (else every registered one, or the first to register).
Stopping the service leaves the engines running.

With ``cluster.prfaas.enabled`` a second, Prefill-as-a-Service cluster joins once the local one serves
(``xservice/cluster/prfaas/serve.py``, docs/prfaas.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from xengine.api.cluster.store import BaseMetadataStore, StoreUnavailableError
from xengine.api.security import ClusterKey
from xservice.cluster.colocation import Colocation
from xservice.cluster.config import AUTO, ClusterConfig
from xservice.cluster.dynamic_pd import DynamicPD
from xservice.cluster.epd.serve import make_epd, resolve_auto
from xservice.cluster.launchers import BaseLauncher, InstanceSpec, make_launcher
from xservice.cluster.monitor import RuntimeMonitor
from xservice.cluster.pool import InstancePool
from xservice.cluster.prfaas.serve import open_prfaas
from xservice.cluster.registry import InstanceRegistry
from xservice.cluster.roles import RoleTable
from xservice.cluster.supervisor import InstanceSupervisor
from xservice.config import XllmConfig
from xservice.policies import PDPolicy, make_policy
from xservice.policies.colocation import ColocationPolicy
from xservice.policies.dynamic_pd import SLO, DynamicPDPolicy

logger = logging.getLogger(__name__)

EXIT_WATCH_INTERVAL_S = 0.1

ServeHttp = Callable[[XllmConfig, socket.socket, Any, Any, Any], Awaitable[int]]


@contextlib.asynccontextmanager
async def open_service_store(
    cluster: ClusterConfig, key: ClusterKey | None = None
) -> AsyncIterator[tuple[BaseMetadataStore, str]]:
    """The service's store and the URL its engines use to reach it (an embedded store's bridge admits
    only holders of ``key`` when given)."""
    if cluster.registry.store == "etcd":
        from xengine.api.cluster.store.etcd import EtcdStore

        host, _, port = cluster.registry.etcd_endpoint.rpartition(":")
        store = EtcdStore(host or "127.0.0.1", int(port))
        try:
            yield store, cluster.registry.store_url
        finally:
            await store.close()
        return
    from xservice.cluster.store.bridge_server import StoreBridgeServer
    from xservice.cluster.store.embedded import EmbeddedStore

    store = EmbeddedStore()
    bridge = StoreBridgeServer(store, f"tcp://{cluster.launch.engine_host}:0", key)
    try:
        yield store, f"embedded+{bridge.addr}"
    finally:
        await bridge.close()
        await store.close()


async def serve_cluster(
    cfg: XllmConfig, sock: socket.socket, tokenizer: Any, serve_http: ServeHttp, phases: Any
) -> int:
    auto = await resolve_auto(cfg) if cfg.cluster.epd.strategy == AUTO else None
    cfg = auto.cfg if auto is not None else cfg
    cl = cfg.cluster
    key = cl.cluster_key()
    async with open_service_store(cl, key) as (store, engine_store_url):
        registry = InstanceRegistry(
            store, cl.registry.key_prefix, cl.registry.lease_ttl_s, cl.registry.heartbeat_interval_s
        )
        dynamic = await make_dynamic_pd(cl, store)
        pool = InstancePool(
            registry,
            make_policy(cl.routing.policy, cl.routing.cache_match_weight),
            cl.registry.migrate_on_failure,
            PDPolicy(cl.routing.cache_match_weight),
            key,
            dynamic,
            make_colocation(cl, dynamic),
        )
        pool.hang_timeout_s = cfg.service.engine_hang_timeout_s
        if auto is not None:
            pool.epd_auto = auto.view
        index = make_epd(cl, pool, registry)
        launcher: BaseLauncher | None = None
        watcher: asyncio.Task | None = None
        flipper = asyncio.get_running_loop().create_task(dynamic.run()) if dynamic is not None else None
        rebalancer = (
            asyncio.get_running_loop().create_task(pool.colocation.run())
            if pool.colocation is not None
            else None
        )
        try:
            try:
                await registry.start()
            except StoreUnavailableError as e:
                raise StoreUnavailableError(
                    f"{e}; start one (ci/etcd.sh start) or check cluster.registry.etcd_endpoint"
                ) from e
            if cl.external:
                await _wait_for_external(cl, pool, registry)
                async with open_prfaas(cfg, store, engine_store_url, key, pool):
                    return await serve_http(cfg, sock, pool, tokenizer, phases)
            launcher = await asyncio.to_thread(make_launcher, cl.launch.launcher)
            specs = {
                name: InstanceSpec(
                    name,
                    role,
                    cl.launch.engine_for(role, auto.engines[name] if auto is not None else cfg.engine),
                    engine_store_url,
                    cl.registry.key_prefix,
                    cl.launch.engine_host,
                    cl.registry.lease_ttl_s,
                    cl.registry.heartbeat_interval_s,
                    key,
                    nice=cl.launch.engine_nice,
                )  # fmt: skip
                for name, role in cl.instance_specs()
            }
            for spec in specs.values():
                await asyncio.to_thread(launcher.launch, spec)
            print(
                f"xllm: launched {len(specs)} instance(s) with the {cl.launch.launcher} launcher",
                file=sys.stderr,
            )
            pool.supervisor = InstanceSupervisor(
                launcher, specs, cfg.service.restart_policy(), pool.mark_dead, registry.incarnation_of
            )
            watcher = asyncio.get_running_loop().create_task(pool.supervisor.run())
            await pool.wait_for(list(specs), cl.launch.startup_timeout_s)
            async with open_prfaas(cfg, store, engine_store_url, key, pool):  # (a no-op when off)
                return await serve_http(cfg, sock, pool, tokenizer, phases)
        finally:
            for task in (watcher, flipper, rebalancer):
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
            await pool.close()
            if index is not None:
                await index.close()
            if launcher is not None:
                await asyncio.to_thread(launcher.stop_all)
            await registry.close()


async def make_dynamic_pd(cl: ClusterConfig, store: BaseMetadataStore) -> DynamicPD | None:
    """Dynamic PD's controller, with the roles a previous service stored restored (None: static PD)."""
    if cl.pd.mode != "dynamic":
        return None
    roles = RoleTable(store, cl.registry.key_prefix)
    try:
        restored = await roles.load({n: r for n, r in cl.instance_specs() if r in ("prefill", "decode")})
    except StoreUnavailableError as e:
        raise StoreUnavailableError(
            f"{e}; start one (ci/etcd.sh start) or check cluster.registry.etcd_endpoint"
        ) from e
    if restored:
        print(
            "xllm: dynamic PD: roles restored from the store: "
            + ", ".join(f"{n}: {r.role} ({r.num_flips} flip(s))" for n, r in sorted(restored.items())),
            file=sys.stderr,
            flush=True,
        )
    policy = DynamicPDPolicy(
        min_decode=cl.pd.min_decode_instances,
        min_prefill=cl.pd.min_prefill_instances,
        cooldown_s=cl.pd.flip_cooldown_s,
        min_interval_s=cl.pd.flip_min_interval_s,
        idle_s=cl.pd.prefill_idle_s,
        sustain_s=cl.pd.tpot_miss_sustain_s,
        capacity_pressure=cl.pd.decode_capacity_pressure,
        backlog=cl.pd.prefill_backlog,
        flip_share=cl.pd.flip_share,
    )
    slo = SLO(cl.slo.ttft_ms / 1000, cl.slo.tpot_ms / 1000)
    return DynamicPD(roles, policy, slo, RuntimeMonitor(cl.pd.prefill_idle_s), cl.pd.startup_profile)


def make_colocation(cl: ClusterConfig, dynamic: DynamicPD | None) -> Colocation | None:
    """Co-location's controller (None: off); it shares dynamic PD's monitor when there is one."""
    if not cl.colocation.enabled:
        return None
    policy = ColocationPolicy(cl.slo.tpot_ms / 1000, cl.colocation.headroom)
    monitor = dynamic.monitor if dynamic is not None else RuntimeMonitor(cl.pd.prefill_idle_s)
    return Colocation(
        policy, monitor, cl.colocation.peak_gflops_per_thread * 1e9, cl.colocation.mem_bw_gbps * 1e9
    )


async def _wait_for_external(cl: ClusterConfig, pool: InstancePool, registry: InstanceRegistry) -> None:
    """Attach mode: report the rebuilt index, then wait for the instances to serve."""
    index = registry.kv_index
    registered = sorted(registry.instances)
    blocks = {name: index.num_blocks(name) for name in registered}
    print(
        f"xllm: attach mode: {len(registered)} instance(s) registered "
        f"({', '.join(registered) or 'none yet'}); "
        f"prefix index rebuilt from the store: {sum(blocks.values())} block(s) "
        f"({', '.join(f'{n}: {b}' for n, b in blocks.items()) or '-'})",
        file=sys.stderr,
        flush=True,
    )
    names = [n for n, _ in cl.instance_specs()] or registered
    if names:
        await pool.wait_for(names, cl.launch.startup_timeout_s)
    else:
        print("xllm: waiting for an instance to register (xllm engine ...)", file=sys.stderr, flush=True)
        await pool.wait_for_any(cl.launch.startup_timeout_s)
