"""Data-parallel attention for MoE models: one engine process per rank, the experts split over them.

Each data-parallel rank is a whole engine (its own requests, scheduler, KV cache, attention and
sampling, started by the service, which routes each request to one rank); only the MoE layers span the
ranks: every rank dispatches its own tokens to the experts' ranks by all-to-all and combines what
comes back (``ep_moe._own_tokens``), with no slicing and no all-gather. The ranks step in lock-step:
before every forward a rank takes part in one *round*, an all-reduce of "I run a forward" over the
control group, and a rank with no forward to run takes part in a round every loop iteration; when a
round says another rank runs a forward, a rank without one runs each MoE layer's exchange with no
tokens (``ep_moe.idle_exchange``), so the collectives pair up. All-idle rounds cost one small
all-reduce per ``IDLE_POLL_MS``. A rank that dies breaks its peers' next collective (gloo reports the
closed connection); they fail loudly and the service relaunches all of them together. A rank told to
shut down leaves only after a round in which every rank said it is leaving, so none is left waiting.
See ``docs/data_parallel.md``.
"""

from __future__ import annotations

import dataclasses
import logging

import msgspec
import torch
import torch.distributed as dist

from ops.platforms import Platform
from xengine.api.config import CacheConfig, EngineConfig
from xengine.api.messages import MoeStatsMsg
from xengine.parallel.ep_moe import idle_exchange
from xengine.parallel.group import ExpertParallelGroup, init_expert_parallel, start_expert_parallel
from xengine.parallel.state import ExpertParallel, set_expert_parallel
from xengine.runner.input_batch import ModelInputs

logger = logging.getLogger("xengine.parallel")

IDLE_POLL_MS = 5  # how long an idle rank waits for input between two rounds


class DataParallelRank(ExpertParallelGroup):
    """This engine's place among the data-parallel ranks: its rounds, its idle exchanges."""

    own_pools = True  # a whole engine: its window / state pools as one process builds them
    idle_poll_ms = IDLE_POLL_MS  # the engine process's input wait between two idle rounds

    def __init__(self, ep: ExpertParallel, size: int) -> None:
        super().__init__(ep, [])
        self.data_parallel_size = size
        self.num_rounds = 0
        self.num_idle_exchanges = 0  # rounds this rank had no forward while another rank had one
        self.num_forwards = 0
        self.leaving = False  # this rank is shutting down (drained): it leaves once every rank is
        self.all_leaving = False  # the last round said every rank is leaving

    @classmethod
    def start(cls, config: EngineConfig, backend: str) -> DataParallelRank:  # type: ignore[override]
        par = config.parallel
        if not par.data_parallel_address:
            raise ValueError(
                "data_parallel_size > 1 needs parallel.data_parallel_address: the data-parallel ranks are "
                "engine processes the service starts together (xllm serve / xllm run-batch), not one LLM object"
            )
        ep = init_expert_parallel(
            par.data_parallel_rank, par.data_parallel_size, par.data_parallel_address, backend, par
        )
        ep.data_parallel = True
        logger.info("data-parallel rank %d/%d joined", par.data_parallel_rank, par.data_parallel_size)
        return cls(ep, par.data_parallel_size)

    def check_model_and_cache(self, cache: CacheConfig) -> CacheConfig:
        if not self.ep.layers:
            raise ValueError(
                "data_parallel_size > 1 (data-parallel attention) needs a mixture-of-experts model (e.g. "
                "DeepseekV3ForCausalLM, Qwen3MoeForCausalLM); for a dense model run independent instances"
            )
        return dataclasses.replace(cache, kv_layout="paged")

    def setup(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        """Each rank sizes its own KV pool: nothing to tell anyone."""

    def publish(self, inputs: ModelInputs, block_copies: list[tuple[int, int]]) -> None:
        """Before this rank's forward: a round saying so (the idle ranks then run their exchanges)."""
        self.check()
        self._round(1)
        self.num_forwards += 1
        self.ep.begin_step(self.ep.step_index + 1, 0)

    def after_step(self, forwards_before: int, busy: bool) -> None:
        """An engine step ended: with no forward in flight and none run, a round anyway."""
        if not busy and self.num_forwards == forwards_before:
            self.idle()

    def may_exit(self) -> bool:
        self.leaving = True
        return self.all_leaving

    def idle(self) -> None:
        """A loop iteration without a forward: one round; when another rank runs a forward, this rank's
        share of every MoE layer's exchange."""
        self.check()
        if self._round(0) > 0:
            self.ep.begin_step(self.ep.step_index + 1, 0)
            idle_exchange(self.ep)
            self.num_idle_exchanges += 1

    def _round(self, mine: int) -> int:
        """The ranks running a forward now; also learns whether every rank is leaving."""
        flag = torch.tensor([mine, int(self.leaving)], dtype=torch.int64)
        try:
            dist.all_reduce(flag, group=self.ep.control_group)
        except Exception as e:
            logger.error("data-parallel round failed: %s", e)
            self.failure = (
                f"data-parallel rank {self.ep.rank}: a peer rank is gone ({str(e).splitlines()[0][:200]}); "
                "this engine instance is down"
            )
            raise
        self.num_rounds += 1
        forwards, leaving = flag.tolist()
        self.all_leaving = leaving == self.data_parallel_size
        return forwards

    def stats(self) -> MoeStatsMsg:
        return msgspec.structs.replace(
            super().stats(),
            data_parallel_size=self.data_parallel_size,
            data_parallel_rank=self.ep.rank,
            num_idle_exchanges=self.num_idle_exchanges,
        )

    @property
    def _kind(self) -> str:
        return "data-parallel"

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        set_expert_parallel(None)
        if self.ep.a2a is not None:
            self.ep.a2a.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def start_data_parallel(config: EngineConfig, platform: Platform) -> DataParallelRank:
    """Join the other data-parallel ranks of this instance (blocks until all have)."""
    if config.cache.kv_layout == "xtensor":
        raise ValueError(
            "cache.kv_layout 'xtensor' is not supported with data_parallel_size > 1 yet; use --kv-layout paged"
        )
    spec = config.speculative_config
    if spec.enabled and spec.method != "ngram":
        raise ValueError(
            f"speculative_config.method {spec.method} is not supported with data_parallel_size > 1 yet "
            "(its draft forwards would not pair with the other ranks' rounds); use method ngram"
        )
    return DataParallelRank.start(config, platform.capabilities.dist_backend)


def start_parallel(config: EngineConfig, platform: Platform) -> ExpertParallelGroup | None:
    """This engine's parallel ranks: its place among the data-parallel ranks, or the worker group it
    starts (tensor / expert parallel), or None for one process."""
    if config.parallel.data_parallel_size > 1:
        return start_data_parallel(config, platform)
    return start_expert_parallel(config, platform)
