"""KV memory of a model with recurrent layers (Qwen3-Next, Nemotron-H): attention KV blocks for its
attention layers, and a state pool for its recurrent ones (``memory/recurrent_state.py``).

Budget rule: the state pool comes first out of ``kv_cache_memory_gb`` (one slot per ``max_num_seqs``
running sequence, plus ``state_snapshot_slots`` snapshots: by default four per ``max_num_seqs``, fewer
if they would take over a quarter of the budget); the attention pool gets the rest. With
``num_blocks`` set, the state pool is allocated besides it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from memory.kv_layout import KVCacheSpec, PagedKVLayout
from memory.recurrent_state import RecurrentStateSlots
from memory.recurrent_state_pool import RecurrentStatePool, StateShape
from memory.stateful_kv_cache_manager import StatefulKVCacheManager
from ops.platforms import Platform
from xengine.api.config import CacheConfig, SchedulerConfig
from xengine.api.messages import StatePoolStatsMsg
from xengine.kv_setup import DEFAULT_BLOCK_SIZE, KVSetup, _max_model_len, _num_blocks
from xengine.models.info import ModelInfo

GIB = 1 << 30


@dataclass
class StateSetup:
    pool: RecurrentStatePool
    slots: RecurrentStateSlots
    num_layers: int  # every layer of the model (the forward context lists states per layer)

    def stats(self) -> StatePoolStatsMsg:
        slots = self.slots
        used = slots.num_seq_slots - slots.num_free_seq_slots
        return StatePoolStatsMsg(
            num_layers=len(self.pool.shapes),
            bytes_per_slot=RecurrentStatePool.bytes_per_slot(self.pool.shapes),
            num_seq_slots=slots.num_seq_slots,
            num_free_seq_slots=slots.num_free_seq_slots,
            num_snapshot_slots=slots.num_snapshot_slots,
            num_snapshots=len(slots.by_block),
            num_snapshots_taken=slots.num_snapshots_taken,
            num_snapshot_hits=slots.num_snapshot_hits,
            usage=used / max(slots.num_seq_slots, 1),
        )


def state_shapes(model: torch.nn.Module) -> dict[int, tuple[StateShape, ...]]:
    """The model's recurrent layers and their state tensors (empty for a model without any)."""
    declare = getattr(model, "recurrent_state_shapes", None)
    if declare is None:
        return {}
    return {
        layer: tuple(StateShape(tuple(shape), dtype) for shape, dtype in specs)
        for layer, specs in declare().items()
    }


def build_stateful_kv(
    cache: CacheConfig,
    scheduler: SchedulerConfig,
    info: ModelInfo,
    dtype: torch.dtype,
    platform: Platform,
    max_len: int,
    shapes: dict[int, tuple[StateShape, ...]],
) -> tuple[KVSetup, StateSetup]:
    """The paged KV pool of the attention layers and the state pool of the recurrent ones
    (``kv_caches`` lists every layer; a recurrent layer's entry is an empty placeholder)."""
    if cache.kv_layout == "xtensor":
        raise ValueError(
            "cache.kv_layout xtensor is not supported for models with recurrent layers (their state "
            "is a pool of slots, not pages); use cache.kv_layout paged or auto"
        )
    block_size = cache.block_size or DEFAULT_BLOCK_SIZE
    per_slot = RecurrentStatePool.bytes_per_slot(shapes)
    num_seq = scheduler.max_num_seqs
    budget = int(cache.kv_cache_memory_gb * GIB)
    num_snap = cache.state_snapshot_slots
    if num_snap is None:
        num_snap = min(4 * num_seq, max(0, budget // 4 // max(per_slot, 1)))
    state_bytes = per_slot * (num_seq + num_snap)
    attention = [i for i in range(info.num_layers) if i not in shapes]
    spec = KVCacheSpec(
        len(attention), info.num_kv_heads, info.head_dim, block_size, dtype, cache.kv_cache_dtype
    )
    if cache.num_blocks is None:
        left = budget - state_bytes
        if attention and left < spec.bytes_per_block:
            raise ValueError(
                f"cache.kv_cache_memory_gb {cache.kv_cache_memory_gb} holds the recurrent state pool "
                f"({state_bytes / GIB:.3f} GiB for {num_seq} sequences and {num_snap} snapshots) but no "
                "attention KV block; raise it, or lower scheduler.max_num_seqs / cache.state_snapshot_slots"
            )
        cache = dataclasses.replace(cache, kv_cache_memory_gb=max(left, 1) / GIB)
    num_blocks = _num_blocks(cache, scheduler, spec, max_len) if attention else 1
    max_model_len, limit = _max_model_len(scheduler, spec, num_blocks, max_len)
    if not attention:
        max_model_len, limit = max_len, "the model"
    device = platform.torch_device()
    layout = PagedKVLayout()
    caches = layout.allocate(spec, num_blocks, device) if attention else []
    placeholder = torch.empty(0, dtype=dtype, device=device)
    kv_caches = [placeholder if i in shapes else caches.pop(0) for i in range(info.num_layers)]
    slots = RecurrentStateSlots(
        num_seq, num_snap, block_size, cache.state_snapshot_interval, cache.enable_prefix_caching
    )
    pool = RecurrentStatePool(shapes, num_seq + slots.num_snapshot_slots, device)
    manager = StatefulKVCacheManager(num_blocks, block_size, cache.enable_prefix_caching, slots)
    kv = KVSetup(spec, "paged", layout, kv_caches, manager, max_model_len, limit)
    return kv, StateSetup(pool, slots, info.num_layers)
