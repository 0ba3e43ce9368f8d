"""Shared set-up of the cluster benchmarks: an in-process service side over locally launched engines.

``LocalCluster`` opens the embedded store (served to the engines over loopback ZMQ), a registry, an
``InstancePool`` and a ``LocalLauncher``; ``launch(names)`` starts engine instances and waits until
they registered. Same components as ``xllm serve`` in cluster mode, without HTTP.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path

from xservice.cluster.launchers import InstanceSpec
from xservice.cluster.launchers.local import LocalLauncher
from xservice.cluster.pool import InstancePool
from xservice.cluster.registry import InstanceRegistry
from xservice.cluster.serve import watch_exits
from xservice.cluster.store.bridge_server import StoreBridgeServer
from xservice.cluster.store.embedded import EmbeddedStore
from xservice.config import load_config
from xservice.policies import make_policy


def ensure_model(model: str | None, size: str = "tiny") -> str:
    if model:
        return model
    out = Path(tempfile.gettempdir()) / f"xllm-bench-qwen3-{size}"
    if not (out / "config.json").is_file():
        cmd = [
            sys.executable,
            "-m",
            "xservice",
            "model",
            "make-tiny",
            "--size",
            size,
            "--out",
            str(out),
            "--quiet",
        ]
        subprocess.run(cmd, check=True)
    return str(out)


class LocalCluster:
    def __init__(
        self, model: str, policy: str = "cache_aware", num_blocks: int = 512, max_model_len: int = 1024
    ):
        overrides = {
            "model": {"model": model, "max_model_len": max_model_len, "seed": 0},
            "cache": {"block_size": 16, "num_blocks": num_blocks},
            "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 1024},
            "device": {"device": "cpu", "num_threads": 1},
        }
        self.engine = load_config(None, overrides).engine
        self.policy = policy

    async def __aenter__(self) -> LocalCluster:
        self.store = EmbeddedStore()
        self.bridge = StoreBridgeServer(self.store)
        self.registry = InstanceRegistry(self.store, "/xllm", lease_ttl_s=3.0, heartbeat_interval_s=0.5)
        self.pool = InstancePool(self.registry, make_policy(self.policy))
        self.launcher = LocalLauncher()
        await self.registry.start()
        self.exit_watcher: asyncio.Task | None = None
        return self

    def watch_exits(self, on: bool) -> None:
        if on and self.exit_watcher is None:
            self.exit_watcher = asyncio.get_running_loop().create_task(watch_exits(self.launcher, self.pool))
        elif not on and self.exit_watcher is not None:
            self.exit_watcher.cancel()
            self.exit_watcher = None

    async def launch(
        self, names: list[str], timeout_s: float = 300.0, roles: dict[str, str] | None = None
    ) -> None:
        """Start instances ``names`` (role ``roles[name]``, default ``mixed``) and wait until registered."""
        for name in names:
            role = (roles or {}).get(name, "mixed")
            spec = InstanceSpec(name, role, self.engine, f"embedded+{self.bridge.addr}")
            self.launcher.launch(spec)
        await self.pool.wait_for(names, timeout_s)

    async def __aexit__(self, *exc: object) -> None:
        self.watch_exits(False)
        await self.pool.close()
        await asyncio.to_thread(self.launcher.stop_all)
        await self.registry.close()
        await self.bridge.close()
        await self.store.close()
