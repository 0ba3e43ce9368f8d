"""The sliding-window layers' KV blocks: a pool of their own, bounded per sequence by the window.

A model whose layers attend through a sliding window of ``W`` tokens (Gemma 3, MiMo, Mistral...)
needs, for the next query at position ``q``, only keys from ``q - W + 1`` on. Those layers keep their
KV in this pool, under a block table per sequence parallel to the full-attention one (same block
positions, other block ids). A block wholly behind the window of the sequence's next token is
released as soon as the sequence is scheduled again (each chunk, each decode step, at its end): its
table entry becomes ``NULL_BLOCK``, a block of zeros that is never handed out, so attention kernels
that walk the table read finite values the window mask discards. A sequence thus holds about
``W / block_size + 1`` blocks here however long it grows (plus the chunk being prefilled).

Prefix caching stays window-safe: a released block keeps its cached prefix while it waits in the
free queue, mapped from the full-attention block at the same position (``by_full``). A prefix hit of
``k`` blocks may be used only if every block in the window before position ``k * block_size`` is
still mapped (``safe_length``); the hit is shortened until it is, never taken with a missing window.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from memory.block_pool import BlockPool


class SlotRelease(Protocol):
    """A layout that keeps per-sequence state (xTensor slots)."""

    def released(self, seq_id: str) -> None:
        """The sequence gave all its blocks back."""


NULL_BLOCK = 0  # block 0 of the window pool: zeros, never handed out, stands for released blocks


class SlidingWindowBlocks:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        window: int,
        enable_prefix_caching: bool,
        release_lag: bool = False,
    ) -> None:
        """``release_lag`` (async scheduling): release behind the window of where the sequence stood
        when it was scheduled the time before, not now. A step still in flight (or undone and run
        again: a failed or interrupted async step) reads the blocks its own queries need."""
        if num_blocks < 2:
            raise ValueError("the sliding-window KV pool needs at least two blocks (one is the null block)")
        self.block_size = block_size
        self.window = window
        self.pool = BlockPool(num_blocks)
        assert self.pool.allocate(1) == [NULL_BLOCK]  # held for good: never freed, never written
        self.tables: dict[str, list[int]] = {}
        self._released: dict[str, int] = {}  # entries [0, n) of a table are NULL_BLOCK
        self.release_lag = release_lag
        self._last_computed: dict[str, int] = {}  # release_lag: num_computed at the last allocate
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) of forks
        self.caching = enable_prefix_caching
        # xTensor (``memory/xtensor/window_layout.py``): told when a sequence gave its blocks back
        self.placement: SlotRelease | None = None
        self.by_full: dict[int, int] = {}  # cached full-attention block -> window block, same position
        self._full_of: dict[int, int] = {}  # the inverse
        # told the full-attention blocks that gained / lost their window mapping (KV events)
        self.on_mapped: Callable[[list[int]], None] | None = None
        self.on_unmapped: Callable[[list[int]], None] | None = None
        if enable_prefix_caching:
            self.pool.on_evict = self._evicted

    # ------------------------------------------------------------------ geometry
    def first_needed(self, next_pos: int) -> int:
        """Index of the first block a query at ``next_pos`` (or later) may read."""
        return max(0, next_pos - self.window + 1) // self.block_size

    def blocks_needed_per_sequence(self, chunk_tokens: int) -> int:
        """Most blocks one sequence holds while ``chunk_tokens`` of it are computed in a step."""
        return -(-(self.window - 1 + chunk_tokens) // self.block_size) + 1

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_blocks - 1

    def num_held(self, seq_id: str) -> int:
        """Blocks the sequence holds (released ones not counted)."""
        table = self.tables.get(seq_id, [])
        return sum(1 for b in table[self._released.get(seq_id, 0) :] if b != NULL_BLOCK)

    # ------------------------------------------------------------------ prefix hits
    def safe_length(self, full_block_ids: list[int]) -> int:
        """How many of a prefix hit's blocks can be used: the most ``k`` whose window (the blocks a
        query at ``k * block_size`` reads) is mapped here."""
        k = len(full_block_ids)
        if not self.caching:
            return 0
        missing = [j for j, b in enumerate(full_block_ids) if b not in self.by_full]
        while k > 0:
            first = self.first_needed(k * self.block_size)
            if not any(first <= j < k for j in missing):
                return k
            k -= 1
        return 0

    def _window_of_hit(self, full_block_ids: list[int]) -> tuple[int, list[int]]:
        """``(first index, window blocks)`` a hit of these full blocks brings along."""
        k = len(full_block_ids)
        first = self.first_needed(k * self.block_size)
        return first, [self.by_full[b] for b in full_block_ids[first:k]]

    # ------------------------------------------------------------------ allocation
    def _release_pos(self, seq_id: str, num_computed: int) -> int:
        """The position whose window bounds what may be released now."""
        if not self.release_lag:
            return num_computed
        return min(num_computed, self._last_computed.get(seq_id, 0))

    def release_behind(self, seq_id: str, next_pos: int) -> None:
        """Release the blocks wholly behind the window of a query at ``next_pos``."""
        table = self.tables.get(seq_id)
        if not table:
            return
        first = min(self.first_needed(next_pos), len(table))
        done = self._released.get(seq_id, 0)
        if first <= done:
            return
        freed = [b for b in table[done:first] if b != NULL_BLOCK]
        table[done:first] = [NULL_BLOCK] * (first - done)
        self._released[seq_id] = first
        if freed:
            self.pool.free(freed)

    def shortfall(self, seq_id: str, num_computed: int, num_total: int, prefix: list[int] | None) -> int:
        """Blocks the pool lacks for ``allocate`` (0: it fits), counting blocks released first."""
        table = self.tables.get(seq_id)
        need = -(-num_total // self.block_size)
        first = self.first_needed(num_computed)
        reclaimed = 0
        if table is None:
            have = 0
            if prefix:
                p_first, window = self._window_of_hit(prefix)
                reclaimed = sum(1 for b in window if self.pool.ref_cnt[b] == 0)
                have = len(prefix)
                first = max(first, p_first)
            freeable = 0
        else:
            have = len(table)
            done = self._released.get(seq_id, 0)
            upto = min(self.first_needed(self._release_pos(seq_id, num_computed)), have)
            freeable = sum(1 for b in table[done:upto] if b != NULL_BLOCK and self.pool.ref_cnt[b] == 1)
        num_new = max(0, need - max(have, first))
        return max(0, num_new + reclaimed - self.pool.num_free_blocks - freeable)

    def allocate(self, seq_id: str, num_computed: int, num_total: int, prefix: list[int] | None) -> None:
        """Cover ``num_total`` tokens, releasing what lies behind the window of ``num_computed``;
        a new sequence with a prefix hit (its full blocks) takes the hit's window blocks. Call only
        when ``shortfall`` is 0."""
        table = self.tables.get(seq_id)
        if table is None:
            table = []
            if prefix:
                first, window = self._window_of_hit(prefix)
                self.pool.touch(window)
                table = [NULL_BLOCK] * first + window
                self._released[seq_id] = first
            self.tables[seq_id] = table
        self.release_behind(seq_id, self._release_pos(seq_id, num_computed))
        if self.release_lag:
            self._last_computed[seq_id] = num_computed
        need = -(-num_total // self.block_size)
        if len(table) >= need:
            return
        first = self.first_needed(num_computed)
        nulls = max(0, min(first, need) - len(table))
        table.extend([NULL_BLOCK] * nulls)
        if nulls:
            self._released[seq_id] = max(self._released.get(seq_id, 0), len(table))
        table.extend(self.pool.allocate(need - len(table)))

    def trim(self, seq_id: str, num_tokens: int) -> None:
        """Give back the blocks past the first ``num_tokens`` tokens' (speculative decoding: blocks
        only rejected drafts reached; never cached, never shared)."""
        table = self.tables.get(seq_id)
        need = -(-num_tokens // self.block_size)
        if not table or len(table) <= need:
            return
        tail = [b for b in table[max(need, self._released.get(seq_id, 0)) :] if b != NULL_BLOCK]
        del table[need:]
        self._released[seq_id] = min(self._released.get(seq_id, 0), need)
        if tail:
            self.pool.free(list(reversed(tail)))

    def free(self, seq_id: str) -> None:
        """Release every block of the sequence (tail first, so prefixes outlive their suffixes)."""
        table = self.tables.pop(seq_id, None)
        done = self._released.pop(seq_id, 0)
        self._last_computed.pop(seq_id, None)
        if table:
            held = [b for b in table[done:] if b != NULL_BLOCK]
            self.pool.free(list(reversed(held)))
        if self.placement is not None:
            self.placement.released(seq_id)

    def can_fork(self, parent_id: str, num_tokens: int) -> bool:
        partial = num_tokens % self.block_size != 0
        return not partial or self.pool.num_free_blocks >= 1

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> None:
        """The child shares the parent's window blocks; a partly filled last block is copied."""
        n = -(-num_tokens // self.block_size)
        table = self.tables[parent_id][:n]
        partial = num_tokens % self.block_size != 0
        shared = table[:-1] if partial else table
        self.pool.touch([b for b in shared if b != NULL_BLOCK])
        child = list(shared)
        if partial:
            src = table[-1]
            dst = self.pool.allocate(1)[0]
            if src != NULL_BLOCK:
                self.pending_copies.append((src, dst))
            child.append(dst)
        self.tables[child_id] = child
        self._released[child_id] = min(self._released.get(parent_id, 0), len(child))
        if parent_id in self._last_computed:
            self._last_computed[child_id] = min(self._last_computed[parent_id], num_tokens)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # ------------------------------------------------------------------ prefix cache bookkeeping
    def record(self, seq_id: str, positions: list[tuple[int, int]]) -> None:
        """The full-attention blocks ``(index, full block)`` of the sequence became cached: map each
        to the window block at the same index while the sequence still holds it."""
        if not self.caching:
            return
        table = self.tables.get(seq_id, [])
        mapped = []
        for index, full in positions:
            if full in self.by_full or index >= len(table):
                continue
            block = table[index]
            if block == NULL_BLOCK or block in self._full_of:
                continue
            self.by_full[full] = block
            self._full_of[block] = full
            self.pool.cached[block] = True
            mapped.append(full)
        if mapped and self.on_mapped is not None:
            self.on_mapped(mapped)

    def map_cached(self, full: int, block: int) -> None:
        """Map an imported window block (PD) to the full-attention block at its position."""
        if not self.caching or full in self.by_full:
            return
        self.by_full[full] = block
        self._full_of[block] = full
        self.pool.cached[block] = True
        if self.on_mapped is not None:
            self.on_mapped([full])

    def forget(self, full_block_ids: list[int]) -> None:
        """The full-attention cache dropped these blocks: their window blocks are plain blocks again."""
        for full in full_block_ids:
            block = self.by_full.pop(full, None)
            if block is not None:
                del self._full_of[block]
                self.pool.evict_cached(block)

    def _evicted(self, block: int) -> None:
        """The pool hands a cached window block out again: prefixes through it lose their window."""
        full = self._full_of.pop(block, None)
        if full is not None:
            del self.by_full[full]
            if self.on_unmapped is not None:
                self.on_unmapped([full])
