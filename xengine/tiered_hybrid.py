"""KV tiers for hybrid models: what a window-safe hit needs beside the full-attention blocks.

A hybrid model resumes a prefix of ``k`` blocks only where its other layers can
(``docs/hybrid_memory.md``): a sliding-window layer needs the window blocks a query after the prefix
reads (``span(k)``, about ``window / block_size`` blocks), a recurrent layer the state at exactly the
prefix's end. The tiers keep, beside every full-attention block:

- **window blocks** (each the window layers' KV of one block, stored under a key derived from the
  block's chained hash) only of the spans of *checkpoints*: every ``kv_tiers.window_checkpoint_tokens``
  (default twice the window) tokens of a sequence as it is cached, and where a sequence ends (or is
  preempted), the point a follow-up turn of a chat resumes from. So about one window per two windows of
  prompt is stored, not the window layers' KV of every block;
- **state snapshots**: the recurrent state at each ``cache.state_snapshot_interval`` (the positions the
  recurrent pool snapshots anyway), under a key derived from the hash of the block they end.

Both are cut into records of the full-attention record's size, so they share the tiers' budget,
eviction, disk file and store connection. A tier hit is taken up to the last ``k`` whose window blocks
and (recurrent) snapshot arrived whole; the window blocks are mapped and the snapshot keyed in the L1
pools as after a PD import (``xengine/disagg/hybrid_transfer.py``), so L1's own window-safe checks
accept the hit.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from memory.kv_tiers.records import BlockRecords
from memory.kv_tiers.stack import Probe, TierStack
from memory.recurrent_state import RecurrentStateSlots
from memory.sliding_window import SlidingWindowBlocks


@dataclass
class Claim:
    """Room taken for one resume point's load: window blocks (``write``: filled from the tiers, else an
    L1 block already mapped and only pinned) and a snapshot slot."""

    k: int
    window: list[tuple[int, int, bool]] = field(default_factory=list)  # (position, window block, write)
    slot: int | None = None
    committed: bool = False


@dataclass
class HybridProbe:
    """The full-attention run the tiers hold past the L1 hit, and the last resume point ``k`` (0: none)
    whose window blocks and snapshot some tier holds."""

    full: Probe
    k: int = 0


def _derive(h: int, tag: bytes, i: int) -> int:
    d = hashlib.blake2b(tag + i.to_bytes(4, "little"), digest_size=8, key=h.to_bytes(8, "little"))
    return int.from_bytes(d.digest(), "little")


def _chunks(nbytes: int, chunk_bytes: int) -> int:
    return -(-nbytes // chunk_bytes) if nbytes else 0


class HybridSidecar:
    def __init__(
        self,
        block_size: int,
        interval: int,
        chunk_bytes: int,
        window: SlidingWindowBlocks | None = None,
        window_every_tokens: int = 0,
        window_caches: list[torch.Tensor] | None = None,
        states: RecurrentStateSlots | None = None,
        state_tensors: list[torch.Tensor] | None = None,
    ) -> None:
        if interval % block_size:
            raise ValueError(
                f"cache.state_snapshot_interval {interval} must be a multiple of the block size {block_size}"
            )
        self.block_size = block_size
        self.chunk_bytes = chunk_bytes
        self.window = window
        self.states = states
        self.every = interval // block_size  # blocks between state snapshots
        self.window_records: BlockRecords | None = None
        self.window_every = self.window_chunks = 0
        if window is not None:
            self.window_records = BlockRecords(window_caches or [])
            self.window_every = -(-(window_every_tokens or 2 * window.window) // block_size)
            self.window_chunks = _chunks(self.window_records.record_bytes, chunk_bytes)
        self.state_tensors = list(state_tensors or [])
        self._state_bytes = [t[0].nbytes for t in self.state_tensors]
        self.state_chunks = _chunks(sum(self._state_bytes), chunk_bytes)

    def describe(self) -> str:
        """The checkpoint layout (part of the tiers' layout fingerprint)."""
        wb = self.window_records.record_bytes if self.window_records is not None else 0
        w = self.window.window if self.window is not None else 0
        return repr((w, wb, self.window_every, self.every, self._state_bytes))

    # ------------------------------------------------------------------ geometry
    def span(self, k: int) -> range:
        """Positions of the window blocks a query after ``k`` blocks reads (empty: no window layers)."""
        if self.window is None:
            return range(0)
        return range(self.window.first_needed(k * self.block_size), k)

    def usable(self, blocks: list[int]) -> int:
        """How much of an L1 hit of ``blocks`` the hybrid pools let a sequence resume after."""
        n = len(blocks)
        if self.window is not None:
            n = min(n, self.window.safe_length(blocks))
        if self.states is not None:
            n = min(n, self.states.usable_blocks(blocks))
        return n

    def resume_points(self, lo: int, hi: int) -> list[int]:
        """Block counts ``k``, ``lo < k <= hi``, a sequence could resume after (last first): any with window
        layers only, the state snapshots' with recurrent layers."""
        return [k for k in range(hi, lo, -1) if self.states is None or k % self.every == 0]

    def window_keys(self, h: int) -> list[int]:
        """Tier keys of the window blocks at the block whose chained hash is ``h``."""
        return [_derive(h, b"xllm-window", i) for i in range(self.window_chunks)]

    def state_keys(self, h: int) -> list[int]:
        """Tier keys of the state snapshot at the end of the block whose chained hash is ``h``."""
        return [_derive(h, b"xllm-state", i) for i in range(self.state_chunks)]

    def window_positions(self, done: int, n: int, ended: bool) -> list[int]:
        """Positions whose window blocks are saved once blocks ``[done, n)`` of a sequence are cached:
        the spans of the checkpoints among them, and of ``n`` when the sequence ``ended``."""
        if self.window is None:
            return []
        step = self.window_every
        ks = list(range((done // step + 1) * step, n + 1, step))
        if ended and n and (not ks or ks[-1] != n):
            ks.append(n)
        return sorted({j for k in ks for j in self.span(k)})

    # ------------------------------------------------------------------ saves (engine thread, then worker)
    def pin_windows(self, fulls: list[int]) -> list[tuple[int, int]]:
        """``(index in fulls, window block)`` of the cached full blocks ``fulls`` whose window block is
        mapped, pinned until ``unpin``."""
        assert self.window is not None
        out = [(i, w) for i, f in enumerate(fulls) if (w := self.window.by_full.get(f)) is not None]
        self.window.pool.touch([w for _, w in out])
        return out

    def pin_state(self, last: int) -> int | None:
        """The snapshot slot keyed by ``last``, pinned until ``unpin``."""
        assert self.states is not None
        slot = self.states.by_block.get(last)
        if slot is not None:
            self.states.pin(slot)
        return slot

    def unpin(self, wins: list[int], slot: int | None) -> None:
        if wins:
            assert self.window is not None
            self.window.pool.free(list(reversed(wins)))
        if slot is not None:
            assert self.states is not None
            self.states.unpin(slot)

    def pack_windows(self, wins: list[int]) -> torch.Tensor:
        """On the worker: window blocks as ``[len(wins) * window_chunks, chunk_bytes]`` records."""
        assert self.window_records is not None
        n, width = len(wins), self.window_chunks * self.chunk_bytes
        out = torch.zeros((n, width), dtype=torch.uint8)
        out[:, : self.window_records.record_bytes].copy_(self.window_records.gather(wins))
        return out.view(n * self.window_chunks, self.chunk_bytes)

    def pack_state(self, slot: int) -> torch.Tensor:
        """On the worker: a snapshot as ``[state_chunks, chunk_bytes]`` records."""
        out = torch.zeros((self.state_chunks, self.chunk_bytes), dtype=torch.uint8)
        flat, at = out.view(-1), 0
        for t, n in zip(self.state_tensors, self._state_bytes):
            flat[at : at + n].copy_(t[slot].reshape(-1).view(torch.uint8).cpu())
            at += n
        return out

    # ------------------------------------------------------------------ loads
    def probe(
        self, stack: TierStack, keys: list[int], hashes: list[int], first: int, usable: int, mapped: set[int]
    ) -> HybridProbe:
        """On the worker: the full-attention run past the L1 hit (``keys``: the hashes of blocks ``first``
        on; ``hashes``: of every whole block), then the last ``k`` beyond ``usable`` within reach whose
        window blocks (``mapped``: positions L1 has them for) and snapshot the tiers hold."""
        full = stack.probe(keys)
        reach = first + full.num_blocks
        cands = self.resume_points(usable, reach)
        if not cands:
            return HybridProbe(full)
        have: set[int] = set(mapped)
        if self.window is not None:
            wanted = [j for j in range(self.span(cands[-1]).start, reach) if j not in mapped]
            held = stack.held([key for j in wanted for key in self.window_keys(hashes[j])])
            wc = self.window_chunks
            have.update(j for i, j in enumerate(wanted) if all(held[i * wc : (i + 1) * wc]))
        for k in cands:
            if any(j not in have for j in self.span(k)):
                continue
            if self.states is not None and not all(stack.held(self.state_keys(hashes[k - 1]))):
                continue
            return HybridProbe(full, k)
        return HybridProbe(full)

    def claim(self, k: int, fulls: list[int], first: int) -> Claim | None:
        """Room for resume point ``k``'s window blocks and snapshot (``fulls``: full blocks of positions
        ``[0, first)`` held in L1); None when a pool has none left."""
        claim = Claim(k)
        span = self.span(k)
        if self.window is not None:
            pool = self.window.pool
            reuse = {j: self.window.by_full.get(fulls[j]) for j in span if j < first}
            reuse = {j: w for j, w in reuse.items() if w is not None}
            taken = sum(1 for w in reuse.values() if pool.ref_cnt[w] == 0)
            if pool.num_free_blocks - taken < len(span) - len(reuse):
                return None
            pool.touch(list(reuse.values()))  # before allocating: the allocation must not evict them
            new = iter(pool.allocate(len(span) - len(reuse)))
            claim.window = [(j, reuse[j], False) if j in reuse else (j, next(new), True) for j in span]
        if self.states is not None:
            claim.slot = self.states.take_snapshot_slot()
            if claim.slot is None:
                self.release(claim)
                return None
        return claim

    def load(self, stack: TierStack, hashes: list[int], claim: Claim) -> bool:
        """On the worker: the claim's window blocks and snapshot from the tiers; whether all arrived."""
        rows = [(j, w) for j, w, write in claim.window if write]
        if rows:
            assert self.window_records is not None
            keys = [key for j, _ in rows for key in self.window_keys(hashes[j])]
            out = torch.empty((len(keys), self.chunk_bytes), dtype=torch.uint8)
            if stack.load(keys, stack.probe(keys), out) < len(keys):
                return False
            recs = out.view(len(rows), -1)[:, : self.window_records.record_bytes]
            self.window_records.scatter([w for _, w in rows], recs.contiguous())
        if claim.slot is not None:
            keys = self.state_keys(hashes[claim.k - 1])
            out = torch.empty((len(keys), self.chunk_bytes), dtype=torch.uint8)
            if stack.load(keys, stack.probe(keys), out) < len(keys):
                return False
            flat, at = out.view(-1), 0
            for t, n in zip(self.state_tensors, self._state_bytes):
                t[claim.slot].view(-1).view(torch.uint8).copy_(flat[at : at + n].to(t.device))
                at += n
        return True

    def commit(self, claim: Claim, fulls: list[int]) -> None:
        """The resume point's full blocks are cached (``fulls``, positions ``[0, k)``): map its window
        blocks and key its snapshot, so L1 hits through ``k`` are window-safe; pinned until ``release``."""
        if self.window is not None:
            for j, w, write in claim.window:
                if write:
                    self.window.map_cached(fulls[j], w)
        if claim.slot is not None:
            assert self.states is not None
            last = fulls[claim.k - 1]
            if last in self.states.by_block:  # another snapshot is keyed there meanwhile: keep that one
                self.states.give_back(claim.slot)
                claim.slot = None
            else:
                self.states.key(last, claim.slot)
                self.states.pin(claim.slot)
        claim.committed = True

    def release(self, claim: Claim) -> None:
        """Drop the claim's pins (its window blocks and snapshot stay cached when committed)."""
        if self.window is not None and claim.window:
            self.window.pool.free([w for _, w, _ in reversed(claim.window)])
            claim.window = []
        if claim.slot is not None:
            assert self.states is not None
            if claim.committed:
                self.states.unpin(claim.slot)
            else:
                self.states.give_back(claim.slot)
            claim.slot = None
