"""``SupervisedEngine``: single-node serving's engine backend, restarted when its process dies.

It holds one ``EngineClient`` at a time (a ``DataParallelClient`` of D engine processes with
``data_parallel_size`` D > 1, restarted together). When that engine dies (killed, crashed, hung past
``engine_hang_timeout_s``), its in-flight requests fail with ``EngineDeadError`` and the supervisor
starts a new engine after a backoff chosen by ``RestartPolicy``, registering the rec catalogs again;
meanwhile requests get 503. Once the restart budget is spent it gives up loudly (``/health/live``
fails). The first start is not retried: a broken config fails ``xllm serve`` at once.
See ``docs/operations.md``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import AsyncIterator

from xengine.api.config import EngineConfig
from xengine.api.messages import AddRequest, CatalogInfo, CompletionDelta, EngineInfo, EngineStats
from xservice.engine.client import EngineClient
from xservice.engine.data_parallel import DataParallelClient, start_engine_client
from xservice.engine.errors import EngineDeadError, EngineStartupError
from xservice.policies.restart import RestartPolicy

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.2
LOCAL = "local"  # the instance name single-node mode reports


class SupervisedEngine:
    """Create with ``await SupervisedEngine.start(config, policy, startup_timeout_s)``."""

    info: EngineInfo  # the current engine's

    def __init__(
        self, config: EngineConfig, policy: RestartPolicy, startup_timeout_s: float, hang_timeout_s: float
    ) -> None:
        self._config = config
        self._policy = policy
        self._startup_timeout_s = startup_timeout_s
        self._hang_timeout_s = hang_timeout_s
        self._client: EngineClient | DataParallelClient | None = None
        self._catalogs: dict[str, list[list[int]]] = {}  # registered catalogs, replayed on restart
        self._loras: dict[
            str, str | None
        ] = {}  # LoRA adapters loaded (a path) or unloaded (None) at run time
        self._restart_times: list[float] = []
        self._watch: asyncio.Task[None] | None = None
        self._closed = False
        self.num_restarts = 0
        self.gave_up = False
        self.restarting = False

    @classmethod
    async def start(
        cls,
        config: EngineConfig,
        policy: RestartPolicy | None = None,
        startup_timeout_s: float = 900.0,
        hang_timeout_s: float = 120.0,
    ) -> SupervisedEngine:
        """Start the engine (``EngineStartupError`` if it cannot) and supervise it."""
        self = cls(config, policy or RestartPolicy(), startup_timeout_s, hang_timeout_s)
        self._adopt(await start_engine_client(config, startup_timeout_s))
        self._watch = asyncio.get_running_loop().create_task(self._supervise(), name="engine-supervisor")
        return self

    def _adopt(self, client: EngineClient | DataParallelClient) -> None:
        client.hang_timeout_s = self._hang_timeout_s
        self._client, self.info = client, client.info

    # ------------------------------------------------------------------ supervision

    async def _supervise(self) -> None:
        while not self._closed:
            client = self._client
            if client is not None and client.is_alive:
                await asyncio.sleep(WATCH_INTERVAL_S)
                continue
            if not await self._restart(client):
                return

    async def _restart(self, dead: EngineClient | DataParallelClient | None) -> bool:
        """Replace the dead engine; False once the policy gives up (or the supervisor closed)."""
        self.restarting = True
        reason = "the engine stopped"
        if dead is not None:
            reason = dead.dead_reason or reason
            await dead.close(drain_timeout_s=0.0)  # reaps it (kills a hung one)
        while not self._closed:
            now = time.monotonic()
            delay = self._policy.delay(self._restart_times, now)
            if delay is None:
                self._give_up()
                return False
            _say(f"{reason}; restarting it in {delay:.1f}s (restart {self.num_restarts + 1})")
            await asyncio.sleep(delay)
            self._restart_times.append(time.monotonic())
            self.num_restarts += 1
            try:
                client = await start_engine_client(self._config, self._startup_timeout_s)
            except EngineStartupError as e:
                logger.error("engine restart failed: %s", str(e).splitlines()[0])
                continue
            await self._replay_catalogs(client)
            self._adopt(client)
            self.restarting = False
            _say(f"engine restarted (pid {client.pid}); serving again")
            return True
        return False

    def _give_up(self) -> None:
        self.gave_up, self.restarting = True, False
        _say(
            f"error: the engine died {self._policy.max_restarts + 1} times within "
            f"{self._policy.window_s:.0f}s; giving up (requests get 503, /health/live fails)"
        )

    async def _replay_catalogs(self, client: EngineClient | DataParallelClient) -> None:
        for name, items in self._catalogs.items():
            try:
                await client.register_catalog(name, items)
            except Exception as e:  # noqa: BLE001 - serve without it rather than not at all
                logger.error("re-registering catalog %r after the restart failed: %s", name, e)
        for name, path in self._loras.items():
            try:
                await (
                    client.unload_lora(name) if path is None else client.load_lora(name, path, replace=True)
                )
            except Exception as e:  # noqa: BLE001
                logger.error("redoing LoRA adapter %r's load / unload after the restart failed: %s", name, e)

    # ------------------------------------------------------------------ EngineBackend

    def _current(self) -> EngineClient | DataParallelClient:
        client = self._client
        if client is None or not client.is_alive:
            state = "gave up restarting it" if self.gave_up else "it is restarting"
            raise EngineDeadError(f"the engine is not serving ({state})")
        return client

    async def generate(self, req: AddRequest) -> AsyncIterator[CompletionDelta]:
        async for delta in self._current().generate(req):
            yield delta

    async def abort(self, req_ids: list[str]) -> None:
        if self._client is not None:
            await self._client.abort(req_ids)

    async def stats(self, timeout_s: float = 5.0) -> EngineStats:
        return await self._current().stats(timeout_s)

    async def ping(self, timeout_s: float = 2.0) -> bool:
        client = self._client
        return client is not None and await client.ping(timeout_s)

    async def reset_prefix_cache(self, timeout_s: float = 5.0) -> bool:
        return await self._current().reset_prefix_cache(timeout_s)

    async def register_catalog(
        self, name: str, items: list[list[int]], timeout_s: float = 60.0
    ) -> CatalogInfo:
        info = await self._current().register_catalog(name, items, timeout_s)
        self._catalogs[name] = items
        return info

    async def list_catalogs(self, timeout_s: float = 5.0) -> list[CatalogInfo]:
        return await self._current().list_catalogs(timeout_s)

    async def load_lora(self, name: str, path: str, replace: bool = False, timeout_s: float = 120.0) -> None:
        await self._current().load_lora(name, path, replace, timeout_s)
        self._loras[name] = path  # a restarted engine gets it again

    async def unload_lora(self, name: str, timeout_s: float = 10.0) -> None:
        await self._current().unload_lora(name, timeout_s)
        if self._loras.pop(name, None) is None:  # one the config registers: unloaded again after a restart
            self._loras[name] = None

    @property
    def is_alive(self) -> bool:
        client = self._client
        return not self._closed and client is not None and client.is_alive

    @property
    def health(self) -> str:
        """ "ok" (serving), "restarting" or "failed" (the supervisor gave up, or it is closed)."""
        if self.is_alive:
            return "ok"
        return "failed" if self.gave_up or self._closed else "restarting"  # (death noticed, restart due)

    def restart_counts(self) -> dict[str, int]:
        return {LOCAL: self.num_restarts}

    def given_up(self) -> list[str]:
        return [LOCAL] if self.gave_up else []

    @property
    def num_inflight(self) -> int:
        return self._client.num_inflight if self._client is not None else 0

    @property
    def pid(self) -> int:
        return self._client.pid if self._client is not None else -1

    async def close(self, drain_timeout_s: float = 10.0) -> None:
        self._closed = True
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        if self._client is not None:
            await self._client.close(drain_timeout_s)


def _say(message: str) -> None:
    print(f"xllm: {message}", file=sys.stderr, flush=True)
