"""The engine's KV memory: layout, block size, pool size, context limit and the block manager.

``build_kv`` turns the cache and scheduler config into a ready ``KVSetup``: the paged layout, or
xTensor where the platform maps pages (``cache.kv_layout``; ``auto`` asks the platform). With xTensor
and no explicit ``block_size``, the smallest power of two from 16 up whose page fits the device's
page and whose mappings fit the process's budget is taken. ``cache.kv_cache_dtype`` int8 / fp8 makes
the pool hold 8-bit rows with their scales (``ops/kv_quant.py``): the same ``kv_cache_memory_gb`` buys
about twice bf16's tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from memory.kv_cache_manager import KVCacheManager
from memory.kv_layout import BaseKVLayout, KVCacheSpec, PagedKVLayout
from memory.xtensor import XTensorKVLayout
from ops.platforms import Platform
from xengine.api.config import CacheConfig, SchedulerConfig
from xengine.api.messages import XTensorStatsMsg
from xengine.models.info import ModelInfo

DEFAULT_BLOCK_SIZE = 16
# xTensor pages are one block of one layer's K (or V): on CPU a 4 KiB OS page takes 16-128 tokens; a
# CUDA / NPU device page is 2 MiB, i.e. ~1024 tokens of a 2 KiB-per-token layer and 8192 of a small
# model's 256 bytes per token (memory is mapped per page as sequences grow, so big blocks cost no more)
XTENSOR_BLOCK_SIZES = tuple(16 << i for i in range(13))  # 16 .. 65536
XTENSOR_LOOKAHEAD_BLOCKS = 1  # pages a sequence will need next are mapped while the current step runs


@dataclass
class KVSetup:
    spec: KVCacheSpec
    layout_name: str  # "paged" | "xtensor"
    layout: BaseKVLayout
    kv_caches: list[torch.Tensor]  # per layer, paged view ([2, num_blocks, block_size, Hkv, D])
    manager: KVCacheManager
    max_model_len: int
    len_limit: str  # what set max_model_len (for error messages)

    def xtensor_stats(self) -> XTensorStatsMsg | None:
        """The xTensor page pool's counters (None: the paged layout)."""
        if not isinstance(self.layout, XTensorKVLayout):
            return None
        return XTensorStatsMsg(**dataclasses.asdict(self.layout.stats(self.manager.pool.ref_cnt)))


def resolve_layout(requested: str, platform: Platform) -> str:
    if requested != "auto":
        if requested == "xtensor" and not platform.capabilities.supports_vmm:
            raise ValueError(
                f"cache.kv_layout 'xtensor' needs VMM support, which {platform.name} lacks; use paged"
            )
        return requested
    return platform.capabilities.default_kv_layout


def build_kv(
    cache: CacheConfig,
    scheduler: SchedulerConfig,
    info: ModelInfo,
    dtype: torch.dtype,
    platform: Platform,
    max_len: int,
    async_scheduling: bool = False,
) -> KVSetup:
    """Allocate the KV memory for a model that needs at most ``max_len`` tokens per sequence
    (``async_scheduling``: a step may run while the next is prepared)."""
    name = resolve_layout(cache.kv_layout, platform)
    if cache.block_size is not None:
        sizes: tuple[int, ...] = (cache.block_size,)
    else:
        sizes = XTENSOR_BLOCK_SIZES if name == "xtensor" else (DEFAULT_BLOCK_SIZE,)
    for i, block_size in enumerate(sizes):
        spec = KVCacheSpec(
            info.num_layers, info.num_kv_heads, info.head_dim, block_size, dtype, cache.kv_cache_dtype
        )
        num_blocks = _num_blocks(cache, scheduler, spec, max_len)
        max_model_len, limit = _max_model_len(scheduler, spec, num_blocks, max_len)
        layout: BaseKVLayout = PagedKVLayout()
        if name == "xtensor":
            layout = XTensorKVLayout(
                platform.vmm(),
                max_model_len,
                slots_per_chunk=scheduler.max_num_seqs,
                defer_slot_reuse=async_scheduling,
            )
        try:
            kv_caches = layout.allocate(spec, num_blocks, platform.torch_device())
        except ValueError as e:
            layout.close()
            if i + 1 < len(sizes):
                continue
            if spec.kv_cache_dtype != "auto" and cache.block_size is None:
                raise ValueError(
                    f"cache.kv_cache_dtype {spec.kv_cache_dtype}: no xTensor block size up to {block_size} "
                    f"tokens fills whole pages of this device ({e}); 8-bit rows carry a 4-byte scale, so on "
                    "2 MiB device pages use cache.kv_layout paged"
                ) from e
            raise
        xt = name == "xtensor"
        manager = KVCacheManager(
            num_blocks,
            block_size,
            cache.enable_prefix_caching,
            placement=layout if xt else None,  # type: ignore[arg-type]
            lookahead_blocks=XTENSOR_LOOKAHEAD_BLOCKS if xt else 0,
        )
        return KVSetup(spec, name, layout, kv_caches, manager, max_model_len, limit)
    raise AssertionError("unreachable")


def _num_blocks(cache: CacheConfig, scheduler: SchedulerConfig, spec: KVCacheSpec, max_len: int) -> int:
    if cache.num_blocks is not None:
        return cache.num_blocks
    by_memory = int(cache.kv_cache_memory_gb * (1 << 30)) // spec.bytes_per_block
    worst_case = -(-max_len // spec.block_size) * scheduler.max_num_seqs
    return max(1, min(by_memory, worst_case))


def _max_model_len(
    scheduler: SchedulerConfig, spec: KVCacheSpec, num_blocks: int, max_len: int
) -> tuple[int, str]:
    """One request always fits the pool; without chunked prefill it must also fit one step's budget
    (a preempted request recomputes prompt + output in one step)."""
    max_model_len = min(max_len, num_blocks * spec.block_size)
    limit = "the KV pool" if max_model_len < max_len else "the model"
    if not scheduler.enable_chunked_prefill and scheduler.max_num_batched_tokens < max_model_len:
        return scheduler.max_num_batched_tokens, "max_num_batched_tokens (chunked prefill is off)"
    return max_model_len, limit
