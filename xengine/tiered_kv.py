"""KV tiers on the engine side: prompts prefetched from the tiers into the prefix cache, new blocks
saved to them. The tiers themselves are ``memory/kv_tiers/``; ``docs/kv_tiers.md`` is the guide.

The prefix cache stays the landing zone, as for PD import (``xengine/disagg/kv_transfer.py``), so the
scheduler does not change beyond one gate. A waiting request whose prompt's whole blocks go past its
L1 hit is *prefetched*: the tier worker probes which further blocks the tiers hold (by chained hash),
the engine allocates pool blocks for them (pinning the L1 part of the prefix), the worker loads the
records into those blocks, and the engine inserts them into the prefix cache under the prompt's tokens,
pinned until the request is admitted, when it hits them like any cached prefix. ``ready`` is the
scheduler's gate: under ``wait`` a request is not admitted while its prefetch runs, under ``timeout`` at
most ``prefetch_timeout_s``, under ``best_effort`` never held back. Saves follow the write policy
(``memory/kv_tiers/stack.py``): blocks are pinned while the worker copies them out.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from memory.kv_cache_manager import KVCacheManager
from memory.kv_layout import KVCacheSpec
from memory.kv_tiers.base import KVTier
from memory.kv_tiers.disk import DiskTier
from memory.kv_tiers.host import HostTier
from memory.kv_tiers.records import BlockRecords
from memory.kv_tiers.stack import Probe, TierStack
from memory.kv_tiers.store import StoreTier
from memory.kv_tiers.worker import TierWorker
from memory.prefix_cache.radix import RadixPrefixCache
from ops.platforms import Platform
from xengine.api.block_hash import prompt_block_hashes
from xengine.api.config import EngineConfig
from xengine.api.kv_tiers_config import KVTiersConfig
from xengine.api.messages import KVTiersStatsMsg, KVTierStatsMsg
from xengine.kv_setup import KVSetup
from xengine.parallel.group import ExpertParallelGroup
from xengine.request import Request
from xengine.scheduler.scheduler import Scheduler
from xengine.state_setup import StateSetup

logger = logging.getLogger(__name__)

PIN_TIMEOUT_S = 60.0  # a loaded prompt's pin outlives a request that never comes back for it
_MAX_HIT_COUNTS = 1 << 20
_LATENCIES = 1024  # prefetch latencies kept for the percentiles


def layout_fingerprint(model_dir: str, spec: KVCacheSpec, quantization: str) -> int:
    """Names the KV a block record holds: the model (its config and the ends of each weight file, so a
    fine-tune differs from its base), the weights' quantization and the KV layout (block size, layers,
    heads, element type). Instances agreeing on it can share records."""
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
    h.update(repr((geometry, quantization)).encode())
    return int.from_bytes(h.digest(), "little")


@dataclass
class _Prefetch:
    """One request's prefetch: probing, then loading, then done (its blocks cached and pinned)."""

    token_ids: list[int]
    keys: list[int]  # chained hashes of the blocks past the L1 hit
    first: int  # blocks of the prompt the L1 hit covered when it started
    started: float
    deadline: float
    phase: str = "probe"  # probe | load | done
    pinned: list[int] = field(default_factory=list)  # pool blocks held until the request is admitted
    new: list[int] = field(default_factory=list)  # blocks being loaded into
    given_up: bool = False  # admitted before its blocks arrived


class TieredKV:
    def __init__(
        self,
        config: KVTiersConfig,
        kv: KVCacheManager,
        kv_caches: list[torch.Tensor],
        tiers: list[KVTier],
    ) -> None:
        if not isinstance(kv.prefix_cache, RadixPrefixCache):
            raise ValueError("kv_tiers needs the prefix cache (cache.enable_prefix_caching)")
        self.config = config
        self.kv = kv
        self.cache: RadixPrefixCache = kv.prefix_cache
        self.block_size = kv.block_size
        self.records = BlockRecords(kv_caches)
        self.stack = TierStack(tiers, config.write_policy)
        self.worker = TierWorker()
        self._prefetches: dict[str, _Prefetch] = {}
        self._save_pins: dict[int, list[int]] = {}
        self._next_save = 0
        self._hits: dict[int, int] = {}  # selective: L1 prefix hits per block hash
        self._loading_into_cache = False
        self.num_prefetches = self.num_loaded_blocks = self.num_timeouts = self.num_saved = 0
        self.load_s = 0.0
        self._latencies: list[float] = []
        stack = self.stack  # the store connects now, not on the first request's probe
        self.worker.submit(("connect", 0), lambda: [t.contains([]) for t in stack.tiers])
        if config.write_policy == "write_back":
            self.cache.evict_hook = self._evicted
        elif config.write_policy == "write_through":
            self.cache.stored_hook = self._stored

    # ------------------------------------------------------------------ scheduler gate
    def ready(self, req: Request) -> bool:
        """Whether ``req`` may be admitted now (its prefetch, if any, done or not waited for)."""
        if req.num_computed_tokens > 0:
            return True
        pf = self._prefetches.get(req.seq_id)
        if pf is None:
            pf = self._start(req)
            if pf is None:
                return True
        if pf.phase == "done":
            return True
        policy = self.config.prefetch_policy
        if policy == "best_effort" or (policy == "timeout" and time.monotonic() >= pf.deadline):
            if not pf.given_up and policy == "timeout":
                self.num_timeouts += 1
            pf.given_up = True
            return True
        return False

    def _start(self, req: Request) -> _Prefetch | None:
        tokens = req.cache_token_ids
        bs = self.block_size
        num_full = (len(tokens) - 1) // bs  # as the prefix cache matches: one token left to compute
        if num_full < 1:
            return None
        hashes = prompt_block_hashes(tokens[: num_full * bs], bs)
        first = self.cache.match(tokens, num_full).num_blocks
        if self.config.write_policy == "selective":
            self._count_hits(hashes[:first], self.cache.match(tokens, first).block_ids)
        if first == num_full:
            return None
        now = time.monotonic()
        pf = _Prefetch(
            list(tokens[: num_full * bs]), hashes[first:], first, now, now + self.config.prefetch_timeout_s
        )
        self._prefetches[req.seq_id] = pf
        keys = pf.keys
        self.worker.submit(("probe", req.seq_id), lambda: self.stack.probe(keys))
        return pf

    # ------------------------------------------------------------------ between steps
    def poll(self, running: bool, seqs: dict[str, Request]) -> None:
        """Apply finished tier jobs; drop the pins of admitted or vanished requests. Waits a little
        for a job when nothing runs but prefetches (no step to run meanwhile)."""
        wait = 0.002 if not running and self.worker.num_pending else 0.0
        for (kind, key), result, error in self.worker.poll(wait):
            if kind == "connect":
                continue
            if kind == "save":
                self.kv.pool.free(list(reversed(self._save_pins.pop(key))))
            elif kind == "probe":
                self._probed(key, result, error)
            else:
                self._loaded(key, result, error)
        now = time.monotonic()
        for seq_id, pf in list(self._prefetches.items()):
            if pf.phase != "done":
                continue
            req = seqs.get(seq_id)
            admitted = req is None or seq_id in self.kv.block_tables or req.num_computed_tokens > 0
            if admitted or now - pf.started > PIN_TIMEOUT_S:
                self._release(seq_id)

    def _probed(self, seq_id: str, probe: Probe | None, error: BaseException | None) -> None:
        pf = self._prefetches.get(seq_id)
        if pf is None:
            return
        n = probe.num_blocks if probe is not None and error is None else 0
        hit = self.cache.match(pf.token_ids, pf.first).block_ids
        n = min(n, self.kv.pool.num_free_blocks - sum(1 for b in hit if self.kv.pool.ref_cnt[b] == 0))
        if n <= 0 or len(hit) < pf.first:  # nothing held, no room, or the L1 part was evicted meanwhile
            self._done(pf)
            return
        self.num_prefetches += 1
        self.cache.lock(hit)
        pf.pinned = hit
        pf.new = self.kv.pool.allocate(n)
        pf.phase = "load"
        keys, new = pf.keys[:n], pf.new
        tiers = Probe(probe.tiers[:n])
        self.worker.submit(("load", seq_id), lambda: self._load_job(keys, tiers, new))

    def _load_job(self, keys: list[int], probe: Probe, block_ids: list[int]) -> int:
        """On the worker: records from the tiers into the pool blocks ``block_ids``."""
        out = self.records.empty(len(keys))
        got = self.stack.load(keys, probe, out)
        if got:
            self.records.scatter(block_ids[:got], out[:got])
        return got

    def _loaded(self, seq_id: str, got: int | None, error: BaseException | None) -> None:
        pf = self._prefetches.get(seq_id)
        if pf is None:
            return
        got = got if error is None and got is not None else 0
        new, kept = pf.new[got:], pf.new[:got]
        self.kv.pool.free(list(reversed(new)))  # never loaded: back to the free queue, uncached
        if kept:
            bs, n = self.block_size, pf.first + len(kept)
            self._loading_into_cache = True
            try:
                self.cache.insert(pf.token_ids[: n * bs], pf.pinned + kept, pf.first)
            finally:
                self._loading_into_cache = False
            self.num_loaded_blocks += len(kept)
        pf.pinned = pf.pinned + kept
        pf.new = []
        self._done(pf)

    def _done(self, pf: _Prefetch) -> None:
        pf.phase = "done"
        took = time.monotonic() - pf.started
        self.load_s += took
        self._latencies = (self._latencies + [took])[-_LATENCIES:]

    def _release(self, seq_id: str) -> None:
        pf = self._prefetches.pop(seq_id)
        if pf.pinned:
            self.kv.pool.free(list(reversed(pf.pinned)))

    # ------------------------------------------------------------------ saves
    def _stored(self, hashes: list[int], block_ids: list[int]) -> None:
        """write_through: blocks the prefix cache just stored (not those it got from the tiers)."""
        if not self._loading_into_cache:
            self._save(hashes, block_ids)

    def _save(self, hashes: list[int], block_ids: list[int]) -> None:
        self.kv.pool.touch(block_ids)  # pinned while the worker copies them out
        job, self._next_save = self._next_save, self._next_save + 1
        self._save_pins[job] = list(block_ids)
        self.num_saved += len(block_ids)
        records, stack = self.records, self.stack
        ids = list(block_ids)
        self.worker.submit(("save", job), lambda: stack.save(hashes, records.gather(ids)))

    def _evicted(self, hashes: list[int], block_ids: list[int]) -> None:
        """write_back: blocks L1 is about to reuse, copied out now (their KV is overwritten next)."""
        records = self.records.gather(block_ids)
        self.num_saved += len(block_ids)
        job, self._next_save = self._next_save, self._next_save + 1
        self._save_pins[job] = []
        self.worker.submit(("save", job), lambda: self.stack.save(hashes, records))

    def _count_hits(self, hashes: list[int], block_ids: list[int]) -> None:
        """selective: a block is saved once its prefix hits reach ``write_min_hits``."""
        if len(self._hits) > _MAX_HIT_COUNTS:
            self._hits.clear()
        due_h, due_b = [], []
        for h, b in zip(hashes, block_ids):
            n = self._hits.get(h, 0) + 1
            self._hits[h] = n
            if n == self.config.write_min_hits:
                due_h.append(h)
                due_b.append(b)
        if due_h:
            self._save(due_h, due_b)

    def set_event_sink(self, sink: Callable[[str, list[int], list[int]], None]) -> None:
        """Tell ``sink(tier, stored, removed)`` what each tier holds, from now on (called on the tier
        worker's thread), starting with what it holds already (a disk tier's last run)."""
        tiers = self.stack.tiers

        def start() -> None:
            for tier in tiers:
                tier.on_change = sink
                tier.changed(tier.held(), [])

        self.worker.submit(("connect", 2), start)

    # ------------------------------------------------------------------ stats, shutdown
    @property
    def busy(self) -> bool:
        return bool(self.worker.num_pending)

    def stats(self) -> KVTiersStatsMsg:
        lat = sorted(self._latencies)

        def pct(q: float) -> float:
            return 1000 * lat[min(len(lat) - 1, int(q * len(lat)))] if lat else 0.0

        return KVTiersStatsMsg(
            write_policy=self.config.write_policy,
            prefetch_policy=self.config.prefetch_policy,
            tiers=[KVTierStatsMsg(**vars(s)) for s in self.stack.stats()],
            num_prefetches=self.num_prefetches,
            num_loaded_blocks=self.num_loaded_blocks,
            num_prefetch_timeouts=self.num_timeouts,
            num_saved_blocks=self.num_saved,
            load_s=self.load_s,
            load_latency_p50_ms=pct(0.5),
            load_latency_p90_ms=pct(0.9),
        )

    def close(self) -> None:
        self.worker.close()
        self.stack.close()


def build_tiered_kv(
    config: KVTiersConfig,
    kv: KVCacheManager,
    kv_caches: list[torch.Tensor],
    spec: KVCacheSpec,
    fingerprint: int,
    pin_memory: bool = False,
    rank: int | None = None,
) -> TieredKV:
    """The tiers ``config`` asks for over this instance's KV (``rank``: a data-parallel rank's, whose
    disk file is its own)."""
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
    return TieredKV(config, kv, kv_caches, tiers)


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
        (kv.manager.window is not None or state_setup is not None, "a hybrid model's sliding-window or recurrent layers"),
        (parallel is not None and parallel.tp is not None, "tensor parallelism (each rank holds part of a block)"),
        (parallel is not None and config.parallel.data_parallel_size == 1, "expert parallelism without data-parallel attention"),
        (config.speculative_config.enabled and spec_method != "ngram", f"speculative decoding by {spec_method} (its KV is not tiered)"),
    ]  # fmt: skip
    for blocked, why in blockers:
        if blocked:
            raise ValueError(
                f"kv_tiers cannot run with {why} yet; remove the kv_tiers settings or change that"
            )
    fingerprint = layout_fingerprint(model_dir, kv.spec, config.model.quantization)
    rank = config.parallel.data_parallel_rank if config.parallel.data_parallel_size > 1 else None
    pin = platform.torch_device().type != "cpu"
    tiered = build_tiered_kv(tiers, kv.manager, kv.kv_caches, kv.spec, fingerprint, pin, rank)
    scheduler.gates.append(tiered.ready)
    return tiered
