"""The PrfaaS cluster beside the local one (``xllm serve`` with ``cluster.prfaas.enabled``): its own
registry over the same store under ``cluster.prfaas.key_prefix``, its own instance pool, its instances
launched by the service (in ``netns`` when given, bound to ``engine_host``, emulated with
``device_profile`` when given) or attached to, and the router's scheduler loop.

The PrfaaS instances reach the store where the service serves it on the link: for the embedded store a
second bridge on ``store_host``; for etcd, ``etcd_endpoint``.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from typing import Any

from xengine.api.cluster.store import BaseMetadataStore
from xengine.api.config import replace_section
from xengine.api.security import ClusterKey
from xservice.cluster.launchers import InstanceSpec, make_launcher
from xservice.cluster.pool import InstancePool
from xservice.cluster.prfaas.router import PrfaasRouter
from xservice.cluster.registry import InstanceRegistry
from xservice.cluster.supervisor import InstanceSupervisor
from xservice.config import XllmConfig
from xservice.policies import LeastLoadPolicy, PDPolicy


@contextlib.asynccontextmanager
async def _store_url(
    cfg: XllmConfig, store: BaseMetadataStore, local_url: str, key: ClusterKey | None
) -> AsyncIterator[str]:
    """The store's URL as the PrfaaS instances reach it."""
    cl, p = cfg.cluster, cfg.cluster.prfaas
    if cl.registry.store == "etcd":
        yield f"etcd://{p.etcd_endpoint or cl.registry.etcd_endpoint}"
        return
    host = p.store_host or cl.launch.engine_host
    if host == cl.launch.engine_host:
        yield local_url
        return
    from xservice.cluster.store.bridge_server import StoreBridgeServer

    bridge = StoreBridgeServer(store, f"tcp://{host}:0", key)
    try:
        yield f"embedded+{bridge.addr}"
    finally:
        await bridge.close()


@contextlib.asynccontextmanager
async def open_prfaas(
    cfg: XllmConfig, store: BaseMetadataStore, local_url: str, key: ClusterKey | None, local: InstancePool
) -> AsyncIterator[PrfaasRouter | None]:
    """The PrfaaS cluster's router, attached to ``local`` (None when ``cluster.prfaas`` is off)."""
    cl, p = cfg.cluster, cfg.cluster.prfaas
    if not p.enabled:
        yield None
        return
    registry = InstanceRegistry(
        store, p.key_prefix, cl.registry.lease_ttl_s, cl.registry.heartbeat_interval_s
    )
    pool = InstancePool(registry, LeastLoadPolicy(), cl.registry.migrate_on_failure, PDPolicy(), key)
    pool.hang_timeout_s = cfg.service.engine_hang_timeout_s
    router = PrfaasRouter(p, pool, local)
    router.local_tpot_ms = cl.slo.tpot_ms or router.local_tpot_ms
    launcher: Any = None
    tasks: list[asyncio.Task] = []
    async with _store_url(cfg, store, local_url, key) as url:
        try:
            await registry.start()
            names = p.instance_names()
            engine = cfg.engine
            if p.device_profile:
                engine = replace_section(engine, "device", device="emulated", device_profile=p.device_profile)
            if names:
                launcher = await asyncio.to_thread(make_launcher, "local")
                specs = {
                    n: InstanceSpec(
                        n,
                        "prefill",
                        engine,
                        url,
                        p.key_prefix,
                        p.engine_host or cl.launch.engine_host,
                        cl.registry.lease_ttl_s,
                        cl.registry.heartbeat_interval_s,
                        key,
                        nice=cl.launch.engine_nice,
                        netns=p.netns,
                    )  # fmt: skip
                    for n in names
                }
                for spec in specs.values():
                    await asyncio.to_thread(launcher.launch, spec)
                where = f" in network namespace {p.netns}" if p.netns else ""
                print(f"xllm: launched {len(specs)} PrfaaS instance(s){where}", file=sys.stderr, flush=True)
                pool.supervisor = InstanceSupervisor(
                    launcher, specs, cfg.service.restart_policy(), pool.mark_dead, registry.incarnation_of
                )
                tasks.append(asyncio.get_running_loop().create_task(pool.supervisor.run()))
            else:
                print(
                    f"xllm: PrfaaS: waiting for an instance under {p.key_prefix}", file=sys.stderr, flush=True
                )
            timeout = cl.launch.startup_timeout_s
            try:  # a PrfaaS cluster that does not come up leaves the local one serving alone
                await (pool.wait_for(names, timeout) if names else pool.wait_for_any(timeout))
            except TimeoutError as e:
                print(
                    f"xllm: PrfaaS: {e}; serving with the local cluster alone until they register",
                    file=sys.stderr,
                    flush=True,
                )
            local.prfaas = router
            tasks.append(asyncio.get_running_loop().create_task(router.run()))
            yield router
        finally:
            local.prfaas = None
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await pool.close()
            if launcher is not None:
                await asyncio.to_thread(launcher.stop_all)
            await registry.close()
