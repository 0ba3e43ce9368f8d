"""``DataParallelClient``: one instance of ``data_parallel_size`` engine processes, as one client.

With data-parallel attention (``parallel.data_parallel_size`` D > 1) every rank is a whole engine
process with its own requests, KV cache and attention; only the MoE layers' expert exchange spans
them (``xengine/parallel/data_parallel.py``). This client starts the D processes together (each told
its rank and the rendezvous address), sends each new request to the rank that served the same prompt
start before while it is not much busier, else to the one with the fewest in flight
(``xservice/policies/data_parallel.py``), and answers for the instance as a whole: stats summed, the
instance alive only while every rank is. When one rank dies the others cannot step (their collectives
break), so the supervisor closes all of them and starts the D ranks again together.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from collections.abc import AsyncIterator

import msgspec

from xengine.api.config import EngineConfig
from xengine.api.messages import (
    AddRequest,
    CatalogInfo,
    CompletionDelta,
    EngineInfo,
    EngineStats,
    MoeStatsMsg,
)
from xservice.engine.client import EngineClient
from xservice.engine.stats_sum import sum_engine_stats, sum_structs
from xservice.policies.data_parallel import pick_rank

# the MoE stats fields that describe the instance rather than count
SAME_ON_EVERY_RANK = (
    "expert_parallel_size",
    "tensor_parallel_size",
    "data_parallel_size",
    "all_reduce",
    "dual_batch_overlap",
    "num_moe_layers",
    "eplb",
    "num_redundant_experts",
)
AFFINITY_ENTRIES = 4096  # prompt starts remembered for routing
PEER_GONE = "a peer rank is gone"  # how a rank reports that another rank's death broke its step


class DataParallelClient:
    """Create with ``await DataParallelClient.start(config)``; ``ranks[r]`` is rank r's client."""

    info: EngineInfo

    def __init__(self, ranks: list[EngineClient]) -> None:
        self.ranks = ranks
        self._owner: dict[str, int] = {}  # request id -> its rank
        self._last = -1
        self._affinity: dict[int, int] = {}  # prompt start -> the rank that last served it (LRU order)
        self._closed = False
        self.info = msgspec.structs.replace(ranks[0].info)
        self.info.num_total_blocks = sum(c.info.num_total_blocks for c in ranks)

    @classmethod
    async def start(cls, config: EngineConfig, startup_timeout_s: float = 900.0) -> DataParallelClient:
        """Start every rank's engine process (they join each other while loading) and wait for all."""
        config.validate()
        par = config.parallel
        address = f"tcp://127.0.0.1:{_free_port()}"
        configs = [
            dataclasses.replace(
                config,
                parallel=dataclasses.replace(par, data_parallel_rank=r, data_parallel_address=address),
            )
            for r in range(par.data_parallel_size)
        ]
        tasks = [asyncio.create_task(EngineClient.start(c, startup_timeout_s)) for c in configs]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
        if failed:  # the others would wait for it to join until their start-up timeout: stop them now
            for t in tasks:
                t.cancel()  # a start being cancelled kills its process
            done = await asyncio.gather(*tasks, return_exceptions=True)
            live = [c for c in done if isinstance(c, EngineClient)]
            await asyncio.gather(*(c.close(drain_timeout_s=0.0) for c in live), return_exceptions=True)
            raise failed[0].exception()  # type: ignore[misc]
        return cls([t.result() for t in tasks])

    async def close(self, drain_timeout_s: float = 10.0) -> None:
        self._closed = True
        await asyncio.gather(*(c.close(drain_timeout_s) for c in self.ranks), return_exceptions=True)

    # ------------------------------------------------------------------ requests

    async def generate(self, req: AddRequest) -> AsyncIterator[CompletionDelta]:
        start = self._prompt_start(req)
        affinity = self._affinity.get(start) if start is not None else None
        rank = self._last = pick_rank([c.num_inflight for c in self.ranks], self._last, affinity)
        if start is not None:  # the rank whose prefix cache now holds this prompt start
            self._affinity.pop(start, None)
            self._affinity[start] = rank
            if len(self._affinity) > AFFINITY_ENTRIES:
                self._affinity.pop(next(iter(self._affinity)))
        self._owner[req.req_id] = rank
        try:
            async for delta in self.ranks[rank].generate(req):
                yield delta
        finally:
            self._owner.pop(req.req_id, None)

    def _prompt_start(self, req: AddRequest) -> int | None:
        """A key of the prompt's first KV block (None when the prompt does not fill one)."""
        size = self.info.block_size
        ids = req.prompt_token_ids
        return hash(tuple(ids[:size])) if len(ids) >= size else None

    async def abort(self, req_ids: list[str]) -> None:
        for rank, client in enumerate(self.ranks):
            mine = [r for r in req_ids if self._owner.get(r, rank) == rank]
            if mine and client.is_alive:
                await client.abort(mine)

    async def stats(self, timeout_s: float = 5.0) -> EngineStats:
        each = await asyncio.gather(*(c.stats(timeout_s) for c in self.ranks))
        total = sum_engine_stats(each)
        moes = [s.moe for s in each if s.moe is not None]
        total.moe = _merge_moe(moes) if moes else None
        return total

    async def ping(self, timeout_s: float = 2.0) -> bool:
        return all(await asyncio.gather(*(c.ping(timeout_s) for c in self.ranks)))

    async def reset_prefix_cache(self, timeout_s: float = 5.0) -> bool:
        return all(await asyncio.gather(*(c.reset_prefix_cache(timeout_s) for c in self.ranks)))

    async def register_catalog(
        self, name: str, items: list[list[int]], timeout_s: float = 60.0
    ) -> CatalogInfo:
        infos = await asyncio.gather(*(c.register_catalog(name, items, timeout_s) for c in self.ranks))
        return infos[0]

    async def list_catalogs(self, timeout_s: float = 5.0) -> list[CatalogInfo]:
        return await self.ranks[0].list_catalogs(timeout_s)

    async def load_lora(self, name: str, path: str, replace: bool = False, timeout_s: float = 120.0) -> None:
        await asyncio.gather(*(c.load_lora(name, path, replace, timeout_s) for c in self.ranks))

    async def unload_lora(self, name: str, timeout_s: float = 10.0) -> None:
        await asyncio.gather(*(c.unload_lora(name, timeout_s) for c in self.ranks))

    # ------------------------------------------------------------------ health

    @property
    def hang_timeout_s(self) -> float:
        return self.ranks[0].hang_timeout_s

    @hang_timeout_s.setter
    def hang_timeout_s(self, value: float) -> None:
        for c in self.ranks:
            c.hang_timeout_s = value

    @property
    def is_alive(self) -> bool:
        return not self._closed and all(c.is_alive for c in self.ranks)

    @property
    def dead_reason(self) -> str | None:
        dead = [(r, c.dead_reason) for r, c in enumerate(self.ranks) if c.dead_reason is not None]
        if dead:  # the rank that died first, before the ranks it took down with it
            dead.sort(key=lambda d: PEER_GONE in d[1])
            return "; ".join(f"data-parallel rank {r}: {why}" for r, why in dead)
        return "the engine was shut down" if self._closed else None

    @property
    def health(self) -> str:
        return "ok" if self.is_alive else "failed"

    def restart_counts(self) -> dict[str, int]:
        return {}

    def given_up(self) -> list[str]:
        return []

    @property
    def num_inflight(self) -> int:
        return sum(c.num_inflight for c in self.ranks)

    @property
    def pid(self) -> int:
        return self.ranks[0].pid

    @property
    def pids(self) -> list[int]:
        return [c.pid for c in self.ranks]


async def start_engine_client(
    config: EngineConfig, startup_timeout_s: float = 900.0
) -> EngineClient | DataParallelClient:
    """The instance's client: one engine process, or ``data_parallel_size`` of them."""
    if config.parallel.data_parallel_size > 1:
        return await DataParallelClient.start(config, startup_timeout_s)
    return await EngineClient.start(config, startup_timeout_s)


def _merge_moe(moes: list[MoeStatsMsg]) -> MoeStatsMsg:
    """The ranks' MoE counters summed; sizes and settings as every rank has them."""
    total = sum_structs(moes, MoeStatsMsg())
    for name in SAME_ON_EVERY_RANK:
        setattr(total, name, getattr(moes[0], name))
    total.data_parallel_rank = 0
    return total


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
