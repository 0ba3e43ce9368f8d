"""KV cache manager: what the scheduler calls to give requests KV blocks.

It owns the block pool and the prefix cache and keeps each request's block table. The KV
tensors themselves live behind a ``BaseKVLayout`` in the runner; this class deals in ids only,
so a virtually-contiguous layout (xTensor) plugs in without touching the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from memory.block_pool import BlockPool
from memory.prefix_cache import BasePrefixCache, RadixPrefixCache
from memory.prefix_cache.radix import KVEventSink
from memory.recurrent_state import RecurrentStateSlots
from memory.sliding_window import SlidingWindowBlocks


@dataclass
class ComputedPrefix:
    block_ids: list[int]
    num_tokens: int

    def first(self, k: int, block_size: int) -> ComputedPrefix:
        """The hit cut to its first ``k`` blocks (itself when that is all of it)."""
        return self if k == len(self.block_ids) else ComputedPrefix(self.block_ids[:k], k * block_size)


class KVPlacement(Protocol):
    """Where blocks land in memory, when that matters (xTensor: slot positions already mapped)."""

    def preferred_blocks(self, seq_id: str, first: int, count: int) -> list[int | None]:
        """The blocks a sequence would best get for its block positions ``first .. first + count - 1``."""

    def released(self, seq_id: str) -> None:
        """The sequence freed all its blocks."""


class KVCacheManager:
    # the sliding-window layers' own blocks (``memory/hybrid_kv_cache_manager.py``); None: every layer
    # keeps full-length KV in this pool
    window: SlidingWindowBlocks | None = None
    # the recurrent layers' state slots (``memory/stateful_kv_cache_manager.py``); None: no such layers
    states: RecurrentStateSlots | None = None

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        placement: KVPlacement | None = None,
        lookahead_blocks: int = 0,
    ) -> None:
        """``lookahead_blocks``: give each sequence up to this many blocks beyond what it asked for when
        the pool has them, so they can be prepared (mapped) before they are needed."""
        self.block_size = block_size
        self.placement = placement
        self.lookahead_blocks = lookahead_blocks
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache: BasePrefixCache | None = (
            RadixPrefixCache(self.pool, block_size) if enable_prefix_caching else None
        )
        self.block_tables: dict[str, list[int]] = {}
        self._needed: dict[str, int] = {}  # blocks each request's tokens need (the rest: look-ahead)
        self._num_cached_blocks: dict[str, int] = {}  # blocks of a request already in the cache
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block copies for the runner

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.stats().usage

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_table(self, req_id: str) -> list[int]:
        return self.block_tables.get(req_id, [])

    def get_computed_prefix(self, token_ids: list[int]) -> ComputedPrefix:
        """Cached blocks for the longest whole-block prefix of ``token_ids``, leaving at least
        one token to compute (the last token's logits are needed)."""
        if self.prefix_cache is None or len(token_ids) <= 1:
            return ComputedPrefix([], 0)
        max_blocks = (len(token_ids) - 1) // self.block_size
        match = self.prefix_cache.match(token_ids, max_blocks)
        return ComputedPrefix(match.block_ids, match.num_blocks * self.block_size)

    def usable_prefix(self, prefix: ComputedPrefix) -> ComputedPrefix:
        """The part of a (possibly shortened) prefix hit every layer can resume from: all of it here."""
        return prefix

    # ------------------------------------------------------------------ updates
    def allocate_slots(
        self,
        req_id: str,
        num_total_tokens: int,
        prefix: ComputedPrefix | None = None,
        num_computed: int | None = None,
    ) -> bool:
        """Make the request's block table cover ``num_total_tokens`` tokens. All or nothing.
        ``num_computed``: the tokens before this step's (what a sliding window may release behind).

        With ``lookahead_blocks``, up to that many more blocks come along while the pool has room to
        spare; they are given back (``_reclaim_lookahead``) as soon as another request needs them."""
        table = self.block_tables.get(req_id, [])
        need = self.blocks_needed(num_total_tokens)
        if table and len(table) >= need + self.lookahead_blocks:  # covered (most decode steps)
            self._needed[req_id] = need
            return True
        new_prefix = prefix.block_ids if prefix and not table else []
        # prefix blocks that sit in the free queue are taken out of it by touch()
        num_reclaimed = sum(1 for b in new_prefix if self.pool.ref_cnt[b] == 0)
        num_new = need - len(table) - len(new_prefix)
        deficit = max(num_new, 0) + num_reclaimed - self.pool.num_free_blocks
        if deficit > 0 and not self._reclaim_lookahead(deficit, exclude=req_id):
            return False
        if new_prefix:
            assert self.prefix_cache is not None
            self.prefix_cache.lock(new_prefix)
            table = list(new_prefix)
            self._num_cached_blocks[req_id] = len(new_prefix)
        num_new = max(num_new, 0)
        if self.lookahead_blocks:
            # only from spare room: never take what the pool keeps for one block per running request
            spare = self.pool.num_free_blocks - num_new - len(self.block_tables)
            num_new += max(0, min(need + self.lookahead_blocks - len(table) - num_new, spare))
        if num_new > 0:
            table = table + self._allocate(req_id, len(table), num_new)
        self.block_tables[req_id] = table
        self._needed[req_id] = need
        return True

    def _reclaim_lookahead(self, num: int, exclude: str) -> bool:
        """Free up to ``num`` look-ahead blocks (past what their request needs) of other requests;
        True when ``num`` were freed."""
        for req_id, table in self.block_tables.items():
            if num <= 0:
                break
            extra = len(table) - self._needed.get(req_id, len(table))
            if req_id == exclude or extra <= 0:
                continue
            take = min(extra, num)
            self.pool.free(list(reversed(table[-take:])))
            del table[-take:]
            num -= take
        return num <= 0

    def _allocate(self, seq_id: str, first: int, num: int) -> list[int]:
        prefer = self.placement.preferred_blocks(seq_id, first, num) if self.placement is not None else ()
        return self.pool.allocate(num, prefer)

    def has_blocks_to_cache(self, req_id: str, num_computed_tokens: int) -> bool:
        """Whether ``cache_blocks`` would insert anything: a full block completed since the last call
        (checked first, so the caller builds the token list only when one did)."""
        return (
            self.prefix_cache is not None
            and num_computed_tokens // self.block_size > self._num_cached_blocks.get(req_id, 0)
        )

    def cache_blocks(self, req_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        """Insert the request's newly completed full blocks into the prefix cache."""
        if not self.has_blocks_to_cache(req_id, num_computed_tokens):
            return
        num_full = num_computed_tokens // self.block_size
        done = self._num_cached_blocks.get(req_id, 0)
        table = self.block_tables[req_id]
        self.prefix_cache.insert(token_ids[: num_full * self.block_size], table[:num_full], done)
        self._num_cached_blocks[req_id] = num_full

    def trim(self, req_id: str, num_tokens: int) -> None:
        """Give back the blocks past the first ``num_tokens`` tokens' (speculative decoding: the
        blocks only rejected drafts reached), but for ``lookahead_blocks`` that stay as look-ahead
        (reclaimable by others). Never a cached block: those hold computed tokens only."""
        table = self.block_tables.get(req_id)
        if not table:
            return
        need = self.blocks_needed(num_tokens)
        self._needed[req_id] = min(need, len(table))
        keep = need + self.lookahead_blocks
        if len(table) > keep:
            assert need >= self._num_cached_blocks.get(req_id, 0), "trimming a cached block"
            self.pool.free(list(reversed(table[keep:])))
            del table[keep:]

    def free(self, req_id: str) -> None:
        """Release every block of the request (tail first, so prefixes outlive their suffixes)."""
        table = self.block_tables.pop(req_id, None)
        self._num_cached_blocks.pop(req_id, None)
        self._needed.pop(req_id, None)
        if table:
            self.pool.free(list(reversed(table)))
        if self.placement is not None:
            self.placement.released(req_id)

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> bool:
        """Give ``child_id`` the parent's KV for its first ``num_tokens`` tokens.

        Full blocks are shared (ref count); a partially filled last block is copied on write:
        a new block is allocated and a (src, dst) copy queued for the runner.
        """
        table = self.block_tables[parent_id][: self.blocks_needed(num_tokens)]
        partial = num_tokens % self.block_size != 0
        shared = table[:-1] if partial else table
        if partial and self.pool.num_free_blocks < 1 and not self._reclaim_lookahead(1, exclude=parent_id):
            return False
        self.pool.touch(shared)
        child = list(shared)
        if partial:
            dst = self._allocate(child_id, len(shared), 1)[0]
            self.pending_copies.append((table[-1], dst))
            child.append(dst)
        self.block_tables[child_id] = child
        self._needed[child_id] = len(child)
        self._num_cached_blocks[child_id] = min(self._num_cached_blocks.get(parent_id, 0), len(shared))
        return True

    def set_event_sink(self, sink: KVEventSink) -> None:
        """Publish the prefix cache's block events (``stored``, ``removed`` chained hashes) to ``sink``:
        a cluster agent's, for the service's global prefix index (``docs/cluster.md``)."""
        if isinstance(self.prefix_cache, RadixPrefixCache):
            self.prefix_cache.event_sink = sink

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def reset_prefix_cache(self) -> bool:
        return self.prefix_cache.reset() if self.prefix_cache is not None else True
