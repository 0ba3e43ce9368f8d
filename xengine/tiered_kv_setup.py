"""Starting an engine's KV tiers: which tiers its config asks for, what rules them out, and the layout
fingerprint that names its records (``xengine/tiered_kv.py`` runs them; ``docs/kv_tiers.md``)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from memory.kv_cache_manager import KVCacheManager
from memory.kv_layout import KVCacheSpec
from memory.kv_tiers.base import KVTier
from memory.kv_tiers.disk import DiskTier
from memory.kv_tiers.host import HostTier
from memory.kv_tiers.records import BlockRecords
from memory.kv_tiers.store import StoreTier
from ops.platforms import Platform
from xengine.api.config import EngineConfig
from xengine.api.kv_tiers_config import KVTiersConfig
from xengine.kv_setup import KVSetup
from xengine.parallel.group import ExpertParallelGroup
from xengine.scheduler.scheduler import Scheduler
from xengine.state_setup import StateSetup
from xengine.tiered_hybrid import HybridSidecar
from xengine.tiered_kv import TieredKV


def layout_fingerprint(model_dir: str, spec: KVCacheSpec, quantization: str, extra: str = "") -> int:
    """Names the KV a block record holds: the model (its config and the ends of each weight file, so a
    fine-tune differs from its base), the weights' quantization and the KV layout (block size, layers,
    heads, element type; ``extra``: a hybrid model's checkpoint layout). Instances agreeing on it can
    share records."""
    h = hashlib.blake2b(digest_size=8)
    root = Path(model_dir)
    h.update((root / "config.json").read_bytes())
    for f in sorted(root.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f.name.encode() + size.to_bytes(8, "little"))
        with f.open("rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read(1 << 20))
    geometry = (spec.block_size, spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.cache_dtype_name)
    h.update(repr((geometry, quantization, extra)).encode())
    return int.from_bytes(h.digest(), "little")


def build_tiered_kv(
    config: KVTiersConfig,
    kv: KVCacheManager,
    kv_caches: list[torch.Tensor],
    spec: KVCacheSpec,
    fingerprint: int,
    pin_memory: bool = False,
    rank: int | None = None,
    sidecar: HybridSidecar | None = None,
) -> TieredKV:
    """The tiers ``config`` asks for over this instance's KV (``kv_caches``: its full-attention layers';
    ``rank``: a data-parallel rank's, whose disk file is its own; ``sidecar``: a hybrid model's)."""
    records = BlockRecords(kv_caches)
    rb = records.record_bytes
    tiers: list[KVTier] = []
    if config.host_memory_gb > 0:
        tiers.append(HostTier(rb, max(1, int(config.host_memory_gb * (1 << 30)) // rb), pin_memory))
    if config.disk_path:
        path = config.disk_path + (f".dp{rank}" if rank is not None else "")
        tiers.append(DiskTier(path, rb, max(1, int(config.disk_gb * (1 << 30)) // rb), fingerprint))
    if config.store_master:
        tiers.append(StoreTier(config.store_master, config.store_host, rb, fingerprint))
    return TieredKV(config, kv, kv_caches, tiers, sidecar)


def start_tiers(
    config: EngineConfig,
    kv: KVSetup,
    model_dir: str,
    platform: Platform,
    parallel: ExpertParallelGroup | None,
    state_setup: StateSetup | None,
    scheduler: Scheduler,
) -> TieredKV | None:
    """The engine's KV tiers (None: ``kv_tiers`` names none), its scheduler gated on their prefetches;
    ``ValueError`` naming what rules them out for this instance."""
    tiers = config.kv_tiers
    if not tiers.enabled:
        return None
    if tiers.store_master == "auto":
        raise ValueError(
            "kv_tiers.store_master auto needs xllm serve (it starts the store); give host:port here"
        )
    spec_method = config.speculative_config.method
    blockers = [
        (not config.cache.enable_prefix_caching, "cache.enable_prefix_caching off (the tiers back the prefix cache)"),
        (platform.capabilities.emulated, "the emulated device (its KV is a timed stand-in)"),
        (kv.layout_name == "xtensor", "cache.kv_layout xtensor (use paged)"),
        (kv.manager.window is not None and state_setup is not None, "both sliding-window and recurrent layers"),
        (parallel is not None and parallel.tp is not None, "tensor parallelism (each rank holds part of a block)"),
        (parallel is not None and config.parallel.data_parallel_size == 1, "expert parallelism without data-parallel attention"),
        (config.speculative_config.enabled and spec_method != "ngram", f"speculative decoding by {spec_method} (its KV is not tiered)"),
    ]  # fmt: skip
    for blocked, why in blockers:
        if blocked:
            raise ValueError(
                f"kv_tiers cannot run with {why} yet; remove the kv_tiers settings or change that"
            )
    no_kv = state_setup.no_kv_layers if state_setup is not None else frozenset()
    full = [t for i, t in enumerate(kv.kv_caches) if i not in kv.window_layers and i not in no_kv]
    sidecar = _sidecar(config, kv, state_setup, full)
    extra = "" if sidecar is None else sidecar.describe()
    fingerprint = layout_fingerprint(model_dir, kv.spec, config.model.quantization, extra)
    rank = config.parallel.data_parallel_rank if config.parallel.data_parallel_size > 1 else None
    pin = platform.torch_device().type != "cpu"
    tiered = build_tiered_kv(tiers, kv.manager, full, kv.spec, fingerprint, pin, rank, sidecar)
    scheduler.gates.append(tiered.ready)
    return tiered


def _sidecar(
    config: EngineConfig, kv: KVSetup, states: StateSetup | None, full: list[torch.Tensor]
) -> HybridSidecar | None:
    """A hybrid model's checkpoints in the tiers (None: every layer is full attention)."""
    window = kv.manager.window
    if window is None and states is None:
        return None
    return HybridSidecar(
        kv.spec.block_size,
        config.cache.state_snapshot_interval,
        BlockRecords(full).record_bytes,
        window,
        config.kv_tiers.window_checkpoint_tokens,
        [kv.kv_caches[i] for i in sorted(kv.window_layers)],
        states.slots if states is not None else None,
        [t for ts in states.pool.layers.values() for t in ts] if states is not None else None,
    )
