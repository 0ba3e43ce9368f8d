"""KV blocks of a model with recurrent layers: attention KV blocks plus a state slot per sequence.

The attention layers keep KV in this manager's block pool (``KVCacheManager``); the recurrent layers
keep one state per running sequence and snapshots for prefix hits (``memory/recurrent_state.py``).
Every operation covers both, all or nothing: a sequence is admitted only with a block table and a
state slot (else the scheduler preempts or waits), a fork copies the state into a slot of its own, a
finished or preempted sequence frees both. Prefix hits are taken only as far as a state snapshot
exists at their end (``usable_prefix``). See ``docs/hybrid_memory.md``.
"""

from __future__ import annotations

from memory.kv_cache_manager import ComputedPrefix, KVCacheManager, KVPlacement
from memory.prefix_cache import RadixPrefixCache
from memory.prefix_cache.radix import KVEventSink
from memory.recurrent_state import RecurrentStateSlots


def _no_events(stored: list[int], removed: list[int]) -> None:
    """The radix cache's own events are not published (snapshot coverage decides)."""


class StatefulKVCacheManager(KVCacheManager):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        states: RecurrentStateSlots,
        placement: KVPlacement | None = None,
        lookahead_blocks: int = 0,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching, placement, lookahead_blocks)
        self.states = states
        if self.prefix_cache is not None:
            self.prefix_cache.forget_sink = states.forget

    # ------------------------------------------------------------------ KV events
    def set_event_sink(self, sink: KVEventSink) -> None:
        """Publish a block only while a snapshot at or below it on its path exists (a hit through it
        can resume there), and withdraw it when the last such snapshot goes. The service's index
        matches the longest published run from a prompt's start: the instance's usable hit is at most
        that, shortened to the last snapshot inside it (at most one interval)."""
        if not isinstance(self.prefix_cache, RadixPrefixCache):
            return
        self._sink = sink
        self._cover: dict[int, int] = {}  # block -> snapshots keyed at or below it
        self._paths: dict[int, list[int]] = {}  # snapshot's block -> its path when keyed
        self._published: dict[int, int] = {}  # block -> the hash published for it
        self.prefix_cache.event_sink = _no_events  # hashes are computed; events come from here
        self.states.on_keyed = self._covered
        self.states.on_dropped = self._uncovered

    def _covered(self, block: int) -> None:
        assert isinstance(self.prefix_cache, RadixPrefixCache)
        path = self._paths[block] = self.prefix_cache.path_of(block)
        stored = []
        for b in path:
            self._cover[b] = self._cover.get(b, 0) + 1
            h = self.prefix_cache.hash_of(b)
            if b not in self._published and h is not None:
                self._published[b] = h
                stored.append(h)
        if stored:
            self._sink(stored, [])

    def _uncovered(self, block: int) -> None:
        removed = []
        for b in self._paths.pop(block, []):
            left = self._cover.get(b, 0) - 1
            if left > 0:
                self._cover[b] = left
                continue
            self._cover.pop(b, None)
            h = self._published.pop(b, None)
            if h is not None:
                removed.append(h)
        if removed:
            self._sink([], removed)

    # ------------------------------------------------------------------ prefix hits
    def get_computed_prefix(self, token_ids: list[int]) -> ComputedPrefix:
        return self.usable_prefix(super().get_computed_prefix(token_ids))

    def usable_prefix(self, prefix: ComputedPrefix) -> ComputedPrefix:
        """``prefix`` shortened to its last block with a state snapshot (the state at exactly that
        position is what the recurrent layers resume from); that snapshot is kept for this plan."""
        k = self.states.usable_blocks(prefix.block_ids)
        if k:
            self.states.protect(prefix.block_ids[k - 1])
        return prefix.first(k, self.block_size)

    # ------------------------------------------------------------------ updates
    def allocate_slots(
        self,
        req_id: str,
        num_total_tokens: int,
        prefix: ComputedPrefix | None = None,
        num_computed: int | None = None,
    ) -> bool:
        new = req_id not in self.states.slot_of
        hit = prefix.block_ids[-1] if prefix is not None and prefix.block_ids and new else None
        if new and self.states.num_free_seq_slots == 0:
            return False
        if hit is not None and hit not in self.states.by_block:  # its snapshot went: take it again
            return False
        if not super().allocate_slots(req_id, num_total_tokens, prefix, num_computed):
            return False
        start = num_computed if num_computed is not None else (prefix.num_tokens if hit is not None else 0)
        ok = self.states.allocate(req_id, start, num_total_tokens, hit)
        assert ok
        return True

    def cache_blocks(self, req_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        super().cache_blocks(req_id, token_ids, num_computed_tokens)
        positions = self.states.pending_positions(req_id, num_computed_tokens)
        if not positions:
            return
        assert self.prefix_cache is not None
        table = self.block_tables.get(req_id, [])
        block_at = {}
        for pos in positions:
            j = pos // self.block_size - 1
            if j < len(table) and self.pool.cached[table[j]]:
                block_at[pos] = table[j]
        missing = [p for p in positions if p not in block_at]
        if missing:  # another request cached these positions first: key the blocks the cache holds
            top = max(missing) // self.block_size
            cached = self.prefix_cache.match(token_ids[: top * self.block_size], top).block_ids
            for pos in missing:
                j = pos // self.block_size - 1
                if j < len(cached):
                    block_at[pos] = cached[j]
        self.states.record(req_id, num_computed_tokens, block_at)

    def free(self, req_id: str) -> None:
        super().free(req_id)
        self.states.free(req_id)

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> bool:
        if self.states.num_free_seq_slots == 0:
            return False
        if not super().fork(parent_id, child_id, num_tokens):
            return False
        ok = self.states.fork(parent_id, child_id)
        assert ok
        return True

    def reset_prefix_cache(self) -> bool:
        ok = super().reset_prefix_cache()
        if ok:
            self.states.reset()
        return ok
