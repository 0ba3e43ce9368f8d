"""The KV pool and runner a model proposer drafts with (``draft_model.py``, ``head_proposer.py``): paged,
beside the target's, as many blocks as the target's pool (a draft's blocks are smaller, so it holds every
token the target can), run eagerly."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from memory.kv_cache_manager import KVCacheManager
from ops.platforms import Platform
from xengine.api.config import CacheConfig, SchedulerConfig
from xengine.kv_setup import build_kv
from xengine.models.info import ModelInfo
from xengine.runner.model_runner import ModelRunner


@dataclass(frozen=True)
class TargetPool:
    """What a proposer's pool copies from the target's: device, dtype, settings, size and context."""

    platform: Platform
    dtype: torch.dtype
    cache: CacheConfig
    scheduler: SchedulerConfig
    num_blocks: int
    max_model_len: int


@dataclass
class DraftPool:
    kv: KVCacheManager
    runner: ModelRunner
    max_len: int
    caches: list[torch.Tensor]  # one paged tensor per layer  # the longest sequence it holds


def build_draft_pool(
    model: torch.nn.Module, info: ModelInfo, target: TargetPool, max_len: int, prefix_caching: bool
) -> DraftPool:
    """A pool of ``info``'s geometry for ``model`` (its position tables set to the pool's length);
    ``prefix_caching``: as the target's when True, off otherwise."""
    cache = dataclasses.replace(
        target.cache,
        kv_layout="paged",
        num_blocks=target.num_blocks,
        hybrid_kv="off",
        enable_prefix_caching=prefix_caching and target.cache.enable_prefix_caching,
    )
    kv = build_kv(cache, target.scheduler, info, target.dtype, target.platform, max_len)
    model.set_max_model_len(kv.max_model_len)
    runner = ModelRunner(
        model, kv.kv_caches, kv.layout, target.platform, kv.spec.block_size, list(info.eos_token_ids),
        max_model_len=kv.max_model_len, graph_mode="eager",
    )  # fmt: skip
    return DraftPool(kv.manager, runner, kv.max_model_len, kv.kv_caches)
