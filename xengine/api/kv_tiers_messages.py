"""The KV tiers' counters as the engine reports them (``EngineStats.kv_tiers``; ``docs/kv_tiers.md``).
Re-exported by ``messages.py``."""

from __future__ import annotations

import msgspec


class KVTierStatsMsg(msgspec.Struct, kw_only=True):
    """One KV tier's counters since start (``memory/kv_tiers/base.py``: ``TierStats``)."""

    name: str = ""  # host | disk | store
    capacity_blocks: int = 0  # 0: bounded by the tier itself (the store)
    num_blocks: int = 0
    hits: int = 0  # blocks loaded from it
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    writes: int = 0
    evictions: int = 0
    corrupt: int = 0  # blocks that failed their checksum: dropped, recomputed
    errors: int = 0
    loads: int = 0
    load_s: float = 0.0
    available: bool = True


class KVTiersStatsMsg(msgspec.Struct, kw_only=True):
    """KV tiers behind the prefix cache (``xengine/tiered_kv.py``)."""

    write_policy: str = ""
    prefetch_policy: str = ""
    tiers: list[KVTierStatsMsg] = msgspec.field(default_factory=list)
    num_prefetches: int = 0  # requests whose prompt the tiers held beyond the KV pool
    num_loaded_blocks: int = 0  # blocks loaded into the KV pool from the tiers
    num_prefetch_timeouts: int = 0  # requests admitted before their blocks arrived (timeout policy)
    num_saved_blocks: int = 0  # blocks handed to the tiers
    # hybrid models (``xengine/tiered_hybrid.py``): window blocks and state snapshots handed to the
    # tiers, and prefetches that resumed their other layers from the tiers
    num_saved_window_blocks: int = 0
    num_saved_states: int = 0
    num_loaded_checkpoints: int = 0
    load_s: float = 0.0  # summed wall time of prefetches (probe + load)
    load_latency_p50_ms: float = 0.0
    load_latency_p90_ms: float = 0.0
