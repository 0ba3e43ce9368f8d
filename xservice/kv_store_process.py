"""``kv_tiers.store_master: auto``: the service starts the cluster KV store itself (``python -m
xengine.process.kv_store_server``: a ``mooncake_master`` and ``kv_tiers.store_memory_gb`` of memory, on
loopback) before its engines, points their store tier at it, and stops it when it stops
(``docs/kv_tiers.md``). Torch-free: the store is a child process."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys

from xengine.api.entrypoints import KV_STORE_MODULE
from xservice.config import XllmConfig
from xservice.engine.process import child_env

logger = logging.getLogger(__name__)

STORE_START_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class KVStoreProcess:
    def __init__(self, memory_gb: float) -> None:
        cmd = [sys.executable, "-m", KV_STORE_MODULE, "--host", "127.0.0.1", "--port", str(_free_port())]
        cmd += [
            "--metrics-port",
            str(_free_port()),
            "--memory-gb",
            str(memory_gb),
            "--parent-pid",
            str(os.getpid()),
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            env=child_env(),
            start_new_session=True,
            text=True,
        )
        self.address = ""

    async def ready(self) -> str:
        """The master's address once the store serves; ``RuntimeError`` if it exits first."""
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), STORE_START_TIMEOUT_S)
        if not line:
            raise RuntimeError(
                f"the KV store (kv_tiers.store_master auto) exited with {self.proc.wait()}; see its log above"
            )
        self.address = json.loads(line)["store_master"]
        logger.info("KV store started at %s (pid %d)", self.address, self.proc.pid)
        return self.address

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


async def start_auto_store(cfg: XllmConfig) -> tuple[XllmConfig, KVStoreProcess | None]:
    """``cfg`` with ``kv_tiers.store_master`` set to a store started now when it says auto."""
    tiers = cfg.kv_tiers
    if tiers.store_master != "auto":
        return cfg, None
    store = KVStoreProcess(tiers.store_memory_gb)
    try:
        address = await store.ready()
    except BaseException:
        store.stop()
        raise
    return dataclasses.replace(cfg, kv_tiers=dataclasses.replace(tiers, store_master=address)), store
