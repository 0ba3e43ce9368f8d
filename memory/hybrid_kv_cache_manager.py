"""KV blocks of a model with sliding-window layers: full-attention blocks and window blocks side by side.

The full-attention layers keep every token's KV in this manager's own pool (``KVCacheManager``); the
sliding-window layers keep theirs in ``window`` (``memory/sliding_window.py``), bounded by the window.
Both tables of a sequence share block positions. Every operation applies to both pools, all or
nothing: a step is admitted only when both have room (else the scheduler preempts), a fork shares
both, a finished or preempted sequence frees both. Prefix hits are taken only as far as the window
pool still holds each window (``usable_prefix``). See ``docs/hybrid_memory.md``.
"""

from __future__ import annotations

from collections.abc import Callable

from memory.kv_cache_manager import ComputedPrefix, KVCacheManager, KVPlacement
from memory.prefix_cache.radix import KVEventSink
from memory.sliding_window import SlidingWindowBlocks


class HybridKVCacheManager(KVCacheManager):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        window: SlidingWindowBlocks,
        placement: KVPlacement | None = None,
        lookahead_blocks: int = 0,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching, placement, lookahead_blocks)
        self.window = window
        if self.prefix_cache is not None:
            self.prefix_cache.forget_sink = self._forget
        self._published = {}
        # KV tiers (``xengine/tiered_hybrid.py``): told ``(cached full blocks of positions [0, n), done, n,
        # ended)`` after blocks ``[done, n)`` of a sequence were cached and their window blocks mapped, and
        # (``ended``: ``done == n``) when a sequence is about to give its blocks back
        self.cached_hook: Callable[[list[int], int, int, bool], None] | None = None

    def _forget(self, full_blocks: list[int]) -> None:
        """The full-attention cache dropped these blocks: their window mappings and events go too."""
        self.window.forget(full_blocks)
        if self._published:
            self._withdraw(full_blocks)

    # ------------------------------------------------------------------ KV events
    def set_event_sink(self, sink: KVEventSink) -> None:
        """Publish a block only while its window block is mapped too, and withdraw it when either goes.
        The service's index matches the longest run of published blocks from the start of a prompt,
        so every length it reports has its window: routing never chases a hit the instance would
        shorten (it may miss one whose early windows are gone while the last ones stay)."""
        if self.prefix_cache is None:
            return
        self._sink = sink
        self._published: dict[int, int] = {}  # full block -> the hash published for it
        self.prefix_cache.event_sink = self._full_events
        self.window.on_mapped = self._window_mapped
        self.window.on_unmapped = self._withdraw

    def _full_events(self, stored: list[int], removed: list[int]) -> None:
        """The full-attention cache's own events: blocks are published once their window is mapped
        (``_window_mapped``); removals of published ones go through (``_withdraw`` via ``forget``)."""

    def _window_mapped(self, full_blocks: list[int]) -> None:
        assert self.prefix_cache is not None
        stored = []
        for block in full_blocks:
            h = self.prefix_cache.hash_of(block)
            if h is not None and block not in self._published:
                self._published[block] = h
                stored.append(h)
        if stored:
            self._sink(stored, [])

    def _withdraw(self, full_blocks: list[int]) -> None:
        removed = [h for h in (self._published.pop(b, None) for b in full_blocks) if h is not None]
        if removed:
            self._sink([], removed)

    # ------------------------------------------------------------------ prefix hits
    def get_computed_prefix(self, token_ids: list[int]) -> ComputedPrefix:
        return self.usable_prefix(super().get_computed_prefix(token_ids))

    def usable_prefix(self, prefix: ComputedPrefix) -> ComputedPrefix:
        """``prefix`` shortened to the most blocks whose window is still in the window pool."""
        k = self.window.safe_length(prefix.block_ids)
        return prefix.first(k, self.block_size)

    def allocate_slots(
        self,
        req_id: str,
        num_total_tokens: int,
        prefix: ComputedPrefix | None = None,
        num_computed: int | None = None,
    ) -> bool:
        new = req_id not in self.block_tables
        hit = prefix.block_ids if prefix is not None and prefix.block_ids and new else None
        if num_computed is None:  # unknown: release nothing behind the window this time
            num_computed = prefix.num_tokens if hit else 0
        if self.window.shortfall(req_id, num_computed, num_total_tokens, hit) > 0:
            return False
        if not super().allocate_slots(req_id, num_total_tokens, prefix):
            return False
        self.window.allocate(req_id, num_computed, num_total_tokens, hit)
        return True

    def cache_blocks(self, req_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        if not self.has_blocks_to_cache(req_id, num_computed_tokens):
            return
        done = self._num_cached_blocks.get(req_id, 0)
        super().cache_blocks(req_id, token_ids, num_computed_tokens)
        assert self.prefix_cache is not None
        num_full = num_computed_tokens // self.block_size
        table = self.block_tables[req_id]
        new = range(done, num_full)
        if all(self.pool.cached[table[j]] for j in new):  # the usual case: its own blocks went in
            self.window.record(req_id, [(j, table[j]) for j in new])
            cached = table[:num_full]
        else:  # another request cached some of these positions first: map the blocks the cache holds
            cached = self.prefix_cache.match(token_ids[: num_full * self.block_size], num_full).block_ids
            self.window.record(req_id, [(j, cached[j]) for j in range(done, len(cached))])
        if self.cached_hook is not None:
            self.cached_hook(cached, done, len(cached), False)

    def trim(self, req_id: str, num_tokens: int) -> None:
        super().trim(req_id, num_tokens)
        self.window.trim(req_id, num_tokens)

    def free(self, req_id: str) -> None:
        n = self._num_cached_blocks.get(req_id, 0)
        if self.cached_hook is not None and n:
            self.cached_hook(self.block_tables.get(req_id, [])[:n], n, n, True)
        super().free(req_id)
        self.window.free(req_id)

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> bool:
        if not self.window.can_fork(parent_id, num_tokens):
            return False
        if not super().fork(parent_id, child_id, num_tokens):
            return False
        self.window.fork(parent_id, child_id, num_tokens)
        return True
