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

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from memory.kv_cache_manager import KVCacheManager
from memory.kv_tiers.base import KVTier
from memory.kv_tiers.records import BlockRecords
from memory.kv_tiers.stack import Probe, TierStack
from memory.kv_tiers.worker import TierWorker
from memory.prefix_cache.radix import RadixPrefixCache
from xengine.api.block_hash import prompt_block_hashes
from xengine.api.kv_tiers_config import KVTiersConfig
from xengine.api.messages import KVTiersStatsMsg, KVTierStatsMsg
from xengine.request import Request
from xengine.tiered_hybrid import Claim, HybridProbe, HybridSidecar

logger = logging.getLogger(__name__)

PIN_TIMEOUT_S = 60.0  # a loaded prompt's pin outlives a request that never comes back for it
_MAX_HIT_COUNTS = 1 << 20
_LATENCIES = 1024  # prefetch latencies kept for the percentiles


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
    hashes: list[int] = field(default_factory=list)  # hybrid: every whole block's chained hash
    usable: int = 0  # hybrid: blocks of the L1 hit its other layers can resume after
    claim: Claim | None = None  # hybrid: the checkpoint's window blocks and snapshot being loaded


class TieredKV:
    def __init__(
        self,
        config: KVTiersConfig,
        kv: KVCacheManager,
        kv_caches: list[torch.Tensor],
        tiers: list[KVTier],
        sidecar: HybridSidecar | None = None,
    ) -> None:
        """``kv_caches``: the full-attention layers'; ``sidecar``: a hybrid model's other layers
        (``xengine/tiered_hybrid.py``)."""
        if not isinstance(kv.prefix_cache, RadixPrefixCache):
            raise ValueError("kv_tiers needs the prefix cache (cache.enable_prefix_caching)")
        self.config = config
        self.kv = kv
        self.cache: RadixPrefixCache = kv.prefix_cache
        self.block_size = kv.block_size
        self.records = BlockRecords(kv_caches)
        self.stack = TierStack(tiers, config.write_policy)
        self.worker = TierWorker()
        self.sidecar = sidecar
        self._prefetches: dict[str, _Prefetch] = {}
        self._save_pins: dict[int, Callable[[], None]] = {}  # save job -> what frees its pins
        self._next_save = 0
        self._hits: dict[int, int] = {}  # selective: L1 prefix hits per block hash
        self._loading_into_cache = False
        self.num_prefetches = self.num_loaded_blocks = self.num_timeouts = self.num_saved = 0
        self.num_saved_window_blocks = self.num_saved_states = self.num_loaded_checkpoints = 0
        self.load_s = 0.0
        self._latencies: list[float] = []
        stack = self.stack  # the store connects now, not on the first request's probe
        self.worker.submit(("connect", 0), lambda: [t.contains([]) for t in stack.tiers])
        if config.write_policy == "write_back":
            self.cache.evict_hook = self._evicted
        self.cache.stored_hook = self._stored  # (and the prefix cache hashes every block it stores)
        if sidecar is not None and sidecar.window is not None:
            kv.cached_hook = self._window_cached  # type: ignore[attr-defined]
        if sidecar is not None and sidecar.states is not None:
            sidecar.states.recorded_hook = self._state_recorded

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
        l1 = self.cache.match(tokens, num_full).block_ids
        first = len(l1)
        if self.config.write_policy == "selective":
            self._count_hits(hashes[:first], l1)
        side = self.sidecar
        usable = side.usable(l1) if side is not None else first
        if first == num_full if side is None else not side.resume_points(usable, num_full):
            return None
        now = time.monotonic()
        pf = _Prefetch(
            list(tokens[: num_full * bs]), hashes[first:], first, now, now + self.config.prefetch_timeout_s
        )
        self._prefetches[req.seq_id] = pf
        keys, stack = pf.keys, self.stack
        if side is None:
            self.worker.submit(("probe", req.seq_id), lambda: stack.probe(keys))
        else:
            pf.hashes, pf.usable = hashes, usable
            window = side.window
            mapped = {j for j, b in enumerate(l1) if b in window.by_full} if window is not None else set()
            self.worker.submit(
                ("probe", req.seq_id), lambda: side.probe(stack, keys, hashes, first, usable, mapped)
            )
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
                self._save_pins.pop(key)()
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

    def _probed(self, seq_id: str, probe: Probe | HybridProbe | None, error: BaseException | None) -> None:
        pf = self._prefetches.get(seq_id)
        if pf is None:
            return
        k = 0
        if isinstance(probe, HybridProbe):  # a hybrid model: the full blocks up to the resume point found
            k, probe = probe.k, probe.full
        n = probe.num_blocks if probe is not None and error is None else 0
        if self.sidecar is not None:
            n = max(0, k - pf.first) if k and error is None else -1
        hit = self.cache.match(pf.token_ids, pf.first).block_ids
        room = self.kv.pool.num_free_blocks - sum(1 for b in hit if self.kv.pool.ref_cnt[b] == 0)
        if self.sidecar is not None and n > room:
            n = -1  # a checkpoint's blocks come whole or not at all
        n = min(n, room)
        if n < 0 or (n == 0 and not k) or len(hit) < pf.first:
            self._done(pf)  # nothing held, no room, or the L1 part was evicted meanwhile
            return
        if k:
            assert self.sidecar is not None
            pf.claim = self.sidecar.claim(k, hit, pf.first)
            if pf.claim is None:
                self._done(pf)
                return
        self.num_prefetches += 1
        self.cache.lock(hit)
        pf.pinned = hit
        pf.new = self.kv.pool.allocate(n)
        pf.phase = "load"
        keys, new, claim, hashes = pf.keys[:n], pf.new, pf.claim, pf.hashes
        tiers = Probe(probe.tiers[:n])
        self.worker.submit(("load", seq_id), lambda: self._load_job(keys, tiers, new, hashes, claim))

    def _load_job(
        self, keys: list[int], probe: Probe, block_ids: list[int], hashes: list[int], claim: Claim | None
    ) -> tuple[int, bool]:
        """On the worker: records from the tiers into the pool blocks ``block_ids`` (and a hybrid model's
        window blocks and snapshot into those ``claim`` took); how many blocks arrived and whether
        the hybrid part did."""
        out = self.records.empty(len(keys))
        got = self.stack.load(keys, probe, out)
        if got:
            self.records.scatter(block_ids[:got], out[:got])
        if claim is None or got < len(keys):
            return got, False
        assert self.sidecar is not None
        return got, self.sidecar.load(self.stack, hashes, claim)

    def _loaded(self, seq_id: str, result: tuple[int, bool] | None, error: BaseException | None) -> None:
        pf = self._prefetches.get(seq_id)
        if pf is None:
            return
        got, whole = result if error is None and result is not None else (0, False)
        new, kept = pf.new[got:], pf.new[:got]
        self.kv.pool.free(list(reversed(new)))  # never loaded: back to the free queue, uncached
        bs, n = self.block_size, pf.first + len(kept)
        if kept:
            self._loading_into_cache = True
            try:
                self.cache.insert(pf.token_ids[: n * bs], pf.pinned + kept, pf.first)
            finally:
                self._loading_into_cache = False
            self.num_loaded_blocks += len(kept)
        pf.pinned = pf.pinned + kept
        pf.new = []
        claim = pf.claim
        if claim is not None and self.sidecar is not None:
            fulls = self.cache.match(pf.token_ids[: claim.k * bs], claim.k).block_ids
            if whole and len(fulls) == claim.k:
                self.sidecar.commit(claim, fulls)
                self.num_loaded_checkpoints += 1
            else:
                self.sidecar.release(claim)
                pf.claim = None
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
        if pf.claim is not None and self.sidecar is not None:
            self.sidecar.release(pf.claim)

    # ------------------------------------------------------------------ saves
    def _stored(self, hashes: list[int], block_ids: list[int]) -> None:
        """Blocks the prefix cache just stored (not those it got from the tiers): saved under write_through."""
        if not self._loading_into_cache and self.config.write_policy == "write_through":
            self._save(hashes, block_ids)

    def _save(self, hashes: list[int], block_ids: list[int]) -> None:
        self.kv.pool.touch(block_ids)  # pinned while the worker copies them out
        job, self._next_save = self._next_save, self._next_save + 1
        pool, ids = self.kv.pool, list(reversed(block_ids))
        self._save_pins[job] = lambda: pool.free(ids)
        self.num_saved += len(block_ids)
        records, stack = self.records, self.stack
        ids = list(block_ids)
        self.worker.submit(("save", job), lambda: stack.save(hashes, records.gather(ids)))

    def _evicted(self, hashes: list[int], block_ids: list[int]) -> None:
        """write_back: blocks L1 is about to reuse, copied out now (their KV is overwritten next)."""
        records = self.records.gather(block_ids)
        self.num_saved += len(block_ids)
        job, self._next_save = self._next_save, self._next_save + 1
        self._save_pins[job] = lambda: None
        self.worker.submit(("save", job), lambda: self.stack.save(hashes, records))

    # ------------------------------------------------------------------ hybrid models
    def _window_cached(self, fulls: list[int], done: int, n: int, ended: bool) -> None:
        """A window model cached blocks ``[done, n)`` of a sequence (or the sequence ``ended``): save the
        window blocks its checkpoints need (``HybridSidecar.window_positions``)."""
        side = self.sidecar
        assert side is not None
        positions = side.window_positions(done, n, ended)
        hashes = [self.cache.hash_of(fulls[j]) for j in positions]
        kept = [(j, h) for j, h in zip(positions, hashes) if h is not None]
        pinned = side.pin_windows([fulls[j] for j, _ in kept])
        if not pinned:
            return
        keys = [key for i, _ in pinned for key in side.window_keys(kept[i][1])]
        wins = [w for _, w in pinned]
        self.num_saved_window_blocks += len(wins)
        self._save_hybrid(keys, lambda: side.pack_windows(wins), lambda: side.unpin(wins, None))

    def _state_recorded(self, block: int) -> None:
        """A recurrent model keyed a sequence's snapshot by ``block``: save it."""
        side = self.sidecar
        assert side is not None
        h = self.cache.hash_of(block)
        slot = side.pin_state(block) if h is not None else None
        if h is None or slot is None:
            return
        self.num_saved_states += 1
        self._save_hybrid(side.state_keys(h), lambda: side.pack_state(slot), lambda: side.unpin([], slot))

    def _save_hybrid(
        self, keys: list[int], pack: Callable[[], torch.Tensor], unpin: Callable[[], None]
    ) -> None:
        """Every write policy saves a hybrid model's window blocks and snapshots as they are made: they are
        what lets it resume from the tiers at all, and a small part of what it stores."""
        job, self._next_save = self._next_save, self._next_save + 1
        self._save_pins[job] = unpin
        stack = self.stack
        self.worker.submit(("save", job), lambda: stack.save(keys, pack()))

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
            num_saved_window_blocks=self.num_saved_window_blocks,
            num_saved_states=self.num_saved_states,
            num_loaded_checkpoints=self.num_loaded_checkpoints,
            load_s=self.load_s,
            load_latency_p50_ms=pct(0.5),
            load_latency_p90_ms=pct(0.9),
        )

    def close(self) -> None:
        self.worker.close()
        self.stack.close()
