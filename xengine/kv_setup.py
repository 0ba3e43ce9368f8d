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

from memory.hybrid_kv_cache_manager import HybridKVCacheManager
from memory.kv_cache_manager import KVCacheManager
from memory.kv_layout import BaseKVLayout, KVCacheSpec, PagedKVLayout
from memory.sliding_window import SlidingWindowBlocks
from memory.xtensor import XTensorKVLayout
from memory.xtensor.window_layout import WindowXTensorKVLayout
from ops.platforms import Platform
from xengine.api.config import CacheConfig, SchedulerConfig
from xengine.api.messages import WindowPoolStatsMsg, XTensorStatsMsg
from xengine.models.info import ModelInfo
from xengine.models.registry import get_model_class

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
    # hybrid_kv: the layers whose KV is in the sliding-window pool, and that pool's geometry
    window_layers: frozenset[int] = frozenset()
    window_spec: KVCacheSpec | None = None
    window_layout: BaseKVLayout | None = None  # the window pool's (xTensor: slots of its own)

    def xtensor_stats(self) -> XTensorStatsMsg | None:
        """The xTensor page pool's counters (None: the paged layout)."""
        if not isinstance(self.layout, XTensorKVLayout):
            return None
        return XTensorStatsMsg(**dataclasses.asdict(self.layout.stats(self.manager.pool.ref_cnt)))

    def window_stats(self) -> WindowPoolStatsMsg | None:
        """The sliding-window pool's counters (None: no such pool)."""
        window = self.manager.window
        if window is None:
            return None
        total, free = window.num_usable_blocks, window.num_free_blocks
        return WindowPoolStatsMsg(
            window=window.window,
            num_layers=len(self.window_layers),
            num_total_blocks=total,
            num_free_blocks=free,
            num_cached_windows=len(window.by_full),
            usage=1.0 - free / max(total, 1),
        )


def resolve_layout(requested: str, platform: Platform) -> str:
    if requested != "auto":
        if requested == "xtensor" and not platform.capabilities.supports_vmm:
            raise ValueError(
                f"cache.kv_layout 'xtensor' needs VMM support, which {platform.name} lacks; use paged"
            )
        return requested
    return platform.capabilities.default_kv_layout


KVHead = tuple[int, int]  # (num_kv_heads, head_dim) of one token's KV cache entry in one layer


def kv_cache_heads(info: ModelInfo) -> tuple[KVHead, KVHead]:
    """``(num_kv_heads, head_dim)`` of the full-attention layers' KV and of the sliding-window layers':
    ``ModelInfo``'s for both, unless the model class declares its own (``kv_cache_heads(info)``;
    MiMo-V2-Flash's sliding layers have twice the KV heads)."""
    declared = getattr(get_model_class(info.architecture), "kv_cache_heads", None)
    if declared is not None:
        return declared(info)
    return (info.num_kv_heads, info.head_dim), (info.num_kv_heads, info.head_dim)


def build_kv(
    cache: CacheConfig,
    scheduler: SchedulerConfig,
    info: ModelInfo,
    dtype: torch.dtype,
    platform: Platform,
    max_len: int,
    async_scheduling: bool = False,
    sliding_windows: tuple[int | None, ...] = (),
    hybrid_blocker: str | None = None,
) -> KVSetup:
    """Allocate the KV memory for a model that needs at most ``max_len`` tokens per sequence
    (``async_scheduling``: a step may run while the next is prepared). ``sliding_windows``: each
    layer's window (None: full attention); ``hybrid_blocker``: why this instance cannot keep them in
    a pool of their own (``cache.hybrid_kv``), None if it can."""
    name = resolve_layout(cache.kv_layout, platform)
    if _use_window_pool(cache, name, info, sliding_windows, hybrid_blocker):
        return build_hybrid_kv(
            cache, scheduler, info, dtype, platform, max_len, sliding_windows, async_scheduling, name
        )
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


def _use_window_pool(
    cache: CacheConfig,
    layout_name: str,
    info: ModelInfo,
    sliding_windows: tuple[int | None, ...],
    hybrid_blocker: str | None,
) -> bool:
    """Whether the sliding-window layers get a KV pool of their own (``build_hybrid_kv``);
    ``ValueError`` where they need one (``cache.hybrid_kv on``, or KV geometries that one pool cannot
    hold) and cannot have it."""
    if not any(sliding_windows):
        return False
    if cache.hybrid_kv == "off":
        blocker = "cache.hybrid_kv off"
    else:
        every_layer_slides = all(sliding_windows)
        xt = layout_name == "xtensor" and every_layer_slides  # xTensor needs a full-attention pool too
        blocker = hybrid_blocker or ("the xtensor KV layout with every layer sliding" if xt else None)
    if blocker is None:
        return True
    if cache.hybrid_kv == "on":
        raise ValueError(
            f"cache.hybrid_kv on: sliding-window layers cannot keep a pool of their own with {blocker}; "
            "use cache.kv_layout paged without expert parallelism, or cache.hybrid_kv auto / off"
        )
    full_head, window_head = kv_cache_heads(info)
    if window_head != full_head:
        raise ValueError(
            f"{info.architecture} keeps (KV heads, head dim) {window_head} per token in its sliding-window "
            f"layers and {full_head} in its full-attention layers, so its KV needs the sliding-window "
            f"pool of its own (cache.hybrid_kv auto or on), which {blocker} rules out; use cache.hybrid_kv "
            "auto with cache.kv_layout paged, without expert parallelism or full device graphs"
        )
    return False


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


def build_hybrid_kv(
    cache: CacheConfig,
    scheduler: SchedulerConfig,
    info: ModelInfo,
    dtype: torch.dtype,
    platform: Platform,
    max_len: int,
    sliding_windows: tuple[int | None, ...],
    async_scheduling: bool = False,
    layout_name: str = "paged",
) -> KVSetup:
    """The paged layout in two pools: full-attention layers as ``build_kv`` lays them out, the
    sliding-window layers in a pool sized by ``window_pool_blocks`` (their largest window for all of
    them), each pool's blocks sized by its own layers' KV heads (``kv_cache_heads``). Budget: the window
    pool first, the rest of ``kv_cache_memory_gb`` (or ``num_blocks``) to the full-attention pool.
    ``layout_name`` xtensor: each pool is an xTensor layout of its own (``memory/xtensor/window_layout.py``
    for the window pool), with a block size whose pages fit the device's in both."""
    full_head, window_head = kv_cache_heads(info)  # each pool its own page size
    block_size = cache.block_size or DEFAULT_BLOCK_SIZE
    if layout_name == "xtensor" and cache.block_size is None:
        block_size = _xtensor_block_size(platform, [full_head, window_head], dtype, cache.kv_cache_dtype)
    window_layers = frozenset(i for i, w in enumerate(sliding_windows) if w)
    window = max(w for w in sliding_windows if w)
    full_layers = [i for i in range(len(sliding_windows)) if i not in window_layers]

    def spec_of(num_layers: int, head: KVHead) -> KVCacheSpec:
        return KVCacheSpec(num_layers, *head, block_size, dtype, cache.kv_cache_dtype)

    full_spec, window_spec = spec_of(len(full_layers), full_head), spec_of(len(window_layers), window_head)
    least = least_window_blocks(window, block_size, scheduler)
    budget = None if cache.num_blocks is not None else int(cache.kv_cache_memory_gb * (1 << 30))
    num_window = window_pool_blocks(cache, scheduler, window, full_spec, window_spec, max_len, budget)
    if num_window < least:
        raise ValueError(
            f"the sliding-window pool ({num_window} blocks) cannot hold one sequence's window ({window} "
            f"tokens) and a step of max_num_batched_tokens {scheduler.max_num_batched_tokens}: it needs at "
            f"least {least} blocks; raise cache.window_pool_blocks or cache.kv_cache_memory_gb"
        )
    num_full = cache.num_blocks
    if num_full is None:
        assert budget is not None
        worst_case = -(-max_len // block_size) * scheduler.max_num_seqs
        left = budget - num_window * window_spec.bytes_per_block
        if full_spec.bytes_per_block == 0:  # every layer slides: the full pool is bookkeeping only
            num_full = worst_case
        elif left < full_spec.bytes_per_block:
            raise ValueError(
                f"cache.kv_cache_memory_gb {cache.kv_cache_memory_gb} holds the sliding-window pool "
                f"({num_window} blocks) but no full-attention block; raise it or lower cache.window_pool_blocks"
            )
        else:
            num_full = max(1, min(left // full_spec.bytes_per_block, worst_case))
    max_model_len, limit = _max_model_len(scheduler, full_spec, num_full, max_len)
    xt = layout_name == "xtensor"
    layout, window_layout = PagedKVLayout(), PagedKVLayout()
    if xt:
        vmm, seqs = platform.vmm(), scheduler.max_num_seqs
        layout = XTensorKVLayout(vmm, max_model_len, seqs, defer_slot_reuse=async_scheduling)
        window_layout = WindowXTensorKVLayout(vmm, max_model_len, seqs, defer_slot_reuse=async_scheduling)
    device = platform.torch_device()
    full_caches = layout.allocate(full_spec, num_full, device)
    window_caches = window_layout.allocate(window_spec, num_window, device)
    kv_caches = [
        window_caches.pop(0) if i in window_layers else full_caches.pop(0)
        for i in range(len(sliding_windows))
    ]
    blocks = SlidingWindowBlocks(
        num_window, block_size, window, cache.enable_prefix_caching, release_lag=async_scheduling
    )
    if xt:
        blocks.placement = window_layout  # type: ignore[assignment]
    manager = HybridKVCacheManager(
        num_full, block_size, cache.enable_prefix_caching, blocks,
        placement=layout if xt else None,  # type: ignore[arg-type]
        lookahead_blocks=XTENSOR_LOOKAHEAD_BLOCKS if xt else 0,
    )  # fmt: skip
    return KVSetup(
        full_spec, layout_name, layout, kv_caches, manager, max_model_len, limit, window_layers, window_spec,
        window_layout,
    )  # fmt: skip


def _xtensor_block_size(
    platform: Platform, heads: list[KVHead], dtype: torch.dtype, kv_cache_dtype: str
) -> int:
    """The smallest xTensor block size whose pages fill whole device pages for every KV geometry."""
    granularity = platform.vmm().granularity
    for size in XTENSOR_BLOCK_SIZES:
        specs = [KVCacheSpec(1, h, d, size, dtype, kv_cache_dtype) for h, d in heads]
        if all(size * spec.token_bytes % granularity == 0 for spec in specs):
            return size
    raise ValueError(
        "no xTensor block size fills whole device pages for these KV heads; use cache.kv_layout paged"
    )


def window_pool_blocks(
    cache: CacheConfig,
    scheduler: SchedulerConfig,
    window: int,
    full_spec: KVCacheSpec,
    window_spec: KVCacheSpec,
    max_len: int,
    budget: int | None,
) -> int:
    """Blocks of the sliding-window pool (the null block included): ``cache.window_pool_blocks``, else
    the smaller of two rules. By sequences: each of ``max_num_seqs`` holds its window plus two blocks
    (a partly filled one and the next), a step adds up to ``max_num_batched_tokens``, and as much again
    keeps released windows for prefix hits. By memory (``budget`` bytes, when the pools share one):
    the share that lets both pools fill together when every sequence is ``max_len`` tokens long (and
    one step's chunk is in flight), so full-length sequences are never refused for want of window
    blocks; shorter ones leave room in the full-attention pool (set ``max_model_len`` to the longest
    you serve). At least what one sequence needs in a step."""
    if cache.window_pool_blocks is not None:
        return cache.window_pool_blocks
    bs = full_spec.block_size
    per_seq = -(-(window - 1) // bs) + 2
    step = -(-scheduler.max_num_batched_tokens // bs)
    blocks = 2 * (scheduler.max_num_seqs * per_seq + step)
    if budget is not None and full_spec.bytes_per_block:
        # n sequences of max_len: n * (per_seq window blocks + their full blocks) + one step's chunk
        window_bytes = per_seq * window_spec.bytes_per_block
        full_bytes = -(-max_len // bs) * full_spec.bytes_per_block
        n = max(1, (budget - step * window_spec.bytes_per_block) // (window_bytes + full_bytes))
        blocks = min(blocks, n * per_seq + step)
    return max(blocks, least_window_blocks(window, bs, scheduler)) + 1


def least_window_blocks(window: int, block_size: int, scheduler: SchedulerConfig) -> int:
    """The fewest window-pool blocks that hold one sequence's window and a step's chunk."""
    return -(-(window - 1 + scheduler.max_num_batched_tokens) // block_size) + 2
