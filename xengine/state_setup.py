"""KV memory of a model with recurrent layers (Qwen3-Next, Nemotron-H): attention KV blocks for its
attention layers, and a state pool for its recurrent ones (``memory/recurrent_state.py``).

The attention KV is laid out as ``build_kv`` lays out any model's (paged or xTensor), for the attention
layers only. Budget rule: the state pool comes first out of ``kv_cache_memory_gb`` (one slot per ``max_num_seqs``
running sequence, plus ``state_snapshot_slots`` snapshots: by default four per ``max_num_seqs``, fewer
if they would take over a quarter of the budget, plus under speculative decoding ``k`` draft states per
running sequence); the attention pool gets the rest. With
``num_blocks`` set, the state pool is allocated besides it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from memory.recurrent_state import RecurrentStateSlots
from memory.recurrent_state_pool import RecurrentStatePool, StateShape
from memory.stateful_kv_cache_manager import StatefulKVCacheManager
from ops.platforms import Platform
from xengine.api.config import CacheConfig, SchedulerConfig
from xengine.api.messages import StatePoolStatsMsg
from xengine.kv_setup import KVSetup, build_kv
from xengine.models.info import ModelInfo

GIB = 1 << 30


@dataclass
class StateSetup:
    pool: RecurrentStatePool
    slots: RecurrentStateSlots
    num_layers: int  # every layer of the model (the forward context lists states per layer)
    # the layers without attention KV (recurrent ones, and MLP-only blocks): placeholders in kv_caches
    no_kv_layers: frozenset[int] = frozenset()

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


def kv_free_layers(
    model: torch.nn.Module, num_layers: int, shapes: dict[int, tuple[StateShape, ...]]
) -> frozenset[int]:
    """The layers that keep no attention KV: the recurrent ones, and every layer not in the model's
    ``kv_layers()`` where it declares them (Nemotron-H's MLP / MoE blocks)."""
    declare = getattr(model, "kv_layers", None)
    if declare is None:
        return frozenset(shapes)
    kv = set(declare())
    return frozenset(i for i in range(num_layers) if i not in kv)


def build_stateful_kv(
    cache: CacheConfig,
    scheduler: SchedulerConfig,
    info: ModelInfo,
    dtype: torch.dtype,
    platform: Platform,
    max_len: int,
    shapes: dict[int, tuple[StateShape, ...]],
    async_scheduling: bool = False,
    no_kv: frozenset[int] | None = None,
    drafts_per_seq: int = 0,
) -> tuple[KVSetup, StateSetup]:
    """The attention layers' KV (``build_kv``: paged or xTensor) and the recurrent layers' state pool
    (``kv_caches`` lists every layer; a layer without KV (``no_kv``: default the recurrent ones) has an
    empty placeholder). ``drafts_per_seq``: speculative decoding's draft tokens per step, each with a
    state slot of its own per running sequence (``RecurrentStateSlots.plan_drafts``)."""
    per_slot = RecurrentStatePool.bytes_per_slot(shapes)
    num_seq = scheduler.max_num_seqs
    budget = int(cache.kv_cache_memory_gb * GIB)
    num_snap = cache.state_snapshot_slots
    if num_snap is None:
        num_snap = min(4 * num_seq, max(0, budget // 4 // max(per_slot, 1)))
    num_draft = num_seq * drafts_per_seq
    state_bytes = per_slot * (num_seq + num_snap + num_draft)
    no_kv = frozenset(shapes) if no_kv is None else no_kv
    attention = [i for i in range(info.num_layers) if i not in no_kv]
    if not attention:
        raise ValueError("a model whose every layer is recurrent is not supported yet (no attention KV)")
    if cache.num_blocks is None:
        left = budget - state_bytes
        if left <= 0:
            raise ValueError(
                f"cache.kv_cache_memory_gb {cache.kv_cache_memory_gb} holds only the recurrent state pool "
                f"({state_bytes / GIB:.3f} GiB for {num_seq} sequences, {num_snap} snapshots and {num_draft} "
                "draft states); raise "
                "it, or lower scheduler.max_num_seqs / cache.state_snapshot_slots"
            )
        cache = dataclasses.replace(cache, kv_cache_memory_gb=left / GIB)
    attn_info = dataclasses.replace(info, num_layers=len(attention))
    kv = build_kv(cache, scheduler, attn_info, dtype, platform, max_len, async_scheduling)
    slots = RecurrentStateSlots(
        num_seq, num_snap, kv.spec.block_size, cache.state_snapshot_interval, cache.enable_prefix_caching,
        num_draft,
    )  # fmt: skip
    device = platform.torch_device()
    pool = RecurrentStatePool(shapes, num_seq + slots.num_snapshot_slots + num_draft, device)
    base = kv.manager
    kv.manager = StatefulKVCacheManager(
        base.pool.num_blocks, kv.spec.block_size, cache.enable_prefix_caching, slots,
        placement=base.placement, lookahead_blocks=base.lookahead_blocks,
    )  # fmt: skip
    caches = iter(kv.kv_caches)
    placeholder = torch.empty(0, dtype=dtype, device=device)
    kv.kv_caches = [placeholder if i in no_kv else next(caches) for i in range(info.num_layers)]
    return kv, StateSetup(pool, slots, info.num_layers, no_kv)
