"""A cluster's ``EngineStats``: every instance's counters summed into one, as ``/v1/admin/stats``
shows them (the KV usage is the mean, co-location latencies the worst instance's)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from xengine.api.messages import (
    ColocationStatsMsg,
    EngineStats,
    GraphStatsMsg,
    KVTiersStatsMsg,
    KVTierStatsMsg,
    LoRAStatsMsg,
    SpecDecodeStatsMsg,
    StatePoolStatsMsg,
    WindowPoolStatsMsg,
    XTensorStatsMsg,
)

WORST_OF = ("preemption_latency_p50_ms", "preemption_latency_p99_ms", "preemption_latency_max_ms")


def sum_engine_stats(stats: Sequence[EngineStats]) -> EngineStats:
    """One ``EngineStats`` for the instances' (at least one)."""
    total = sum_structs(stats, EngineStats())
    total.kv_usage = sum(s.kv_usage for s in stats) / len(stats)
    total.kv_layout = stats[0].kv_layout
    total.async_scheduling = stats[0].async_scheduling
    xts = [s.xtensor for s in stats if s.xtensor is not None]
    total.xtensor = sum_structs(xts, XTensorStatsMsg()) if xts else None
    windows = [s.window_pool for s in stats if s.window_pool is not None]
    if windows:
        total.window_pool = sum_structs(windows, WindowPoolStatsMsg())
        total.window_pool.window = windows[0].window
        total.window_pool.num_layers = windows[0].num_layers
        total.window_pool.usage = sum(w.usage for w in windows) / len(windows)
    states = [s.state_pool for s in stats if s.state_pool is not None]
    if states:
        total.state_pool = sum_structs(states, StatePoolStatsMsg())
        total.state_pool.num_layers = states[0].num_layers
        total.state_pool.bytes_per_slot = states[0].bytes_per_slot
        total.state_pool.usage = sum(w.usage for w in states) / len(states)
    graphs = [s.graph for s in stats if s.graph is not None]
    if graphs:
        total.graph = sum_structs(graphs, GraphStatsMsg(mode=graphs[0].mode, buckets=graphs[0].buckets))
    cols = [s.colocation for s in stats if s.colocation is not None]
    if cols:
        total.colocation = sum_structs(
            cols, ColocationStatsMsg(offline_preemption=cols[0].offline_preemption)
        )
        for f in WORST_OF:
            setattr(total.colocation, f, max(getattr(c, f) for c in cols))
    specs = [s.spec_decode for s in stats if s.spec_decode is not None]
    if specs:
        spec = sum_structs(specs, SpecDecodeStatsMsg(method=specs[0].method))
        spec.num_speculative_tokens = specs[0].num_speculative_tokens
        width = max(len(x.accepted_per_pos) for x in specs)
        spec.accepted_per_pos = [sum(x.accepted_per_pos[i] for x in specs if i < len(x.accepted_per_pos))
                                 for i in range(width)]  # fmt: skip
        spec.acceptance_rate = (
            spec.num_accepted_tokens / spec.num_draft_tokens if spec.num_draft_tokens else 0.0
        )
        spec.mean_accepted_length = (
            1.0 + spec.num_accepted_tokens / spec.num_drafts if spec.num_drafts else 0.0
        )
        total.spec_decode = spec
    tiers = [s.kv_tiers for s in stats if s.kv_tiers is not None]
    if tiers:
        total.kv_tiers = sum_kv_tiers(tiers)
    loras = [s.lora for s in stats if s.lora is not None]
    if loras:  # the instances' adapter sets united; max_loras and num_adapters are per instance
        total.lora = sum_structs(loras, LoRAStatsMsg())
        total.lora.max_loras, total.lora.num_adapters = loras[0].max_loras, max(x.num_adapters for x in loras)
        for f in ("running_adapters", "waiting_adapters", "slot_adapters"):
            setattr(total.lora, f, sorted({a for x in loras for a in getattr(x, f)}))
    return total


def sum_kv_tiers(items: Sequence[KVTiersStatsMsg]) -> KVTiersStatsMsg:
    """Instances' KV tiers as one: each tier's counters summed by name, latencies the worst instance's."""
    first = items[0]
    total = sum_structs(
        items, KVTiersStatsMsg(write_policy=first.write_policy, prefetch_policy=first.prefetch_policy)
    )
    for f in ("load_latency_p50_ms", "load_latency_p90_ms"):
        setattr(total, f, max(getattr(i, f) for i in items))
    names = list(dict.fromkeys(t.name for i in items for t in i.tiers))
    total.tiers = []
    for name in names:
        same = [t for i in items for t in i.tiers if t.name == name]
        tier = sum_structs(same, KVTierStatsMsg(name=name))
        tier.available = all(t.available for t in same)
        total.tiers.append(tier)
    return total


def sum_structs(items: Sequence[Any], total: Any) -> Any:
    """``total`` with every numeric field set to its sum over ``items`` (other fields untouched)."""
    for f in total.__struct_fields__:
        values = [getattr(i, f) for i in items]
        if values and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            setattr(total, f, sum(values))
    return total
