"""Shared set-up of the cluster benchmarks: an in-process service side over locally launched engines.

``LocalCluster`` is ``xllm serve``'s cluster mode (``xservice/cluster/serve.py``) without HTTP: the
service store (``open_service_store``: the embedded store served to the engines over loopback ZMQ),
a registry, an ``InstancePool`` and a ``LocalLauncher``, with the engine plane and the store's bridge
authenticated by an ephemeral cluster key (ZMQ CURVE). ``launch(names)`` starts engine instances
and waits until they registered; ``supervise(True)`` runs the ``InstanceSupervisor`` over them (a
process that exits is failed over at once and relaunched with backoff, as ``xllm serve`` does).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from xservice.cluster.launchers import InstanceSpec
from xservice.cluster.launchers.local import LocalLauncher
from xservice.cluster.pool import InstancePool
from xservice.cluster.registry import InstanceRegistry
from xservice.cluster.serve import open_service_store
from xservice.cluster.supervisor import InstanceSupervisor
from xservice.config import load_config
from xservice.policies import PDPolicy, make_policy


class LocalCluster:
    def __init__(
        self,
        model: str,
        policy: str = "cache_aware",
        num_blocks: int = 512,
        max_model_len: int = 1024,
        cluster: dict[str, Any] | None = None,
    ):
        """``cluster``: overrides of the ``cluster`` config section by sub-section (``{"registry": {...}}``)."""
        overrides = {
            "model": {"model": model, "max_model_len": max_model_len, "seed": 0},
            "cache": {"block_size": 16, "num_blocks": num_blocks},
            "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 1024},
            "device": {"device": "cpu", "num_threads": 1},
            "cluster": {"routing": {"policy": policy}, **(cluster or {})},
        }
        self.cfg = load_config(None, overrides)
        self.engine = self.cfg.engine
        self.specs: dict[str, InstanceSpec] = {}
        self.supervisor: InstanceSupervisor | None = None
        self._supervising: asyncio.Task | None = None

    async def __aenter__(self) -> LocalCluster:
        cl = self.cfg.cluster
        self.key = cl.cluster_key()
        self._stack = contextlib.AsyncExitStack()
        self.store, self.store_url = await self._stack.enter_async_context(open_service_store(cl, self.key))
        self.registry = InstanceRegistry(
            self.store, cl.registry.key_prefix, cl.registry.lease_ttl_s, cl.registry.heartbeat_interval_s
        )
        self.pool = InstancePool(
            self.registry,
            make_policy(cl.routing.policy, cl.routing.cache_match_weight),
            cl.registry.migrate_on_failure,
            PDPolicy(cl.routing.cache_match_weight),
            self.key,
        )
        self.pool.hang_timeout_s = self.cfg.service.engine_hang_timeout_s
        self.launcher = LocalLauncher()
        await self.registry.start()
        return self

    async def launch(
        self, names: list[str], timeout_s: float = 300.0, roles: dict[str, str] | None = None
    ) -> None:
        """Start instances ``names`` (role ``roles[name]``, default ``mixed``) and wait until registered."""
        if self._supervising is not None:
            raise RuntimeError("launch instances before supervise(True): the supervisor watches a fixed set")
        cl = self.cfg.cluster
        for name in names:
            role = (roles or {}).get(name, "mixed")
            spec = InstanceSpec(
                name, role, self.engine, self.store_url, cl.registry.key_prefix, cl.launch.engine_host,
                cl.registry.lease_ttl_s, cl.registry.heartbeat_interval_s, self.key,
            )  # fmt: skip
            self.specs[name] = spec
            await asyncio.to_thread(self.launcher.launch, spec)
        await self.pool.wait_for(names, timeout_s)

    async def supervise(self, on: bool) -> None:
        """Start (over every instance launched so far) or stop the ``InstanceSupervisor``."""
        if on and self._supervising is None:
            self.supervisor = InstanceSupervisor(
                self.launcher, dict(self.specs), self.cfg.service.restart_policy(), self.pool.mark_dead,
                self.registry.incarnation_of,
            )  # fmt: skip
            self.pool.supervisor = self.supervisor
            self._supervising = asyncio.get_running_loop().create_task(self.supervisor.run())
        elif not on and self._supervising is not None:
            self._supervising.cancel()
            await asyncio.gather(self._supervising, return_exceptions=True)
            self._supervising = None
            self.supervisor = self.pool.supervisor = None

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.supervise(False)
            await self.pool.close()
            await asyncio.to_thread(self.launcher.stop_all)
            await self.registry.close()
        finally:
            await self._stack.aclose()
