"""Block pool: KV block ids with reference counts and an eviction-ordered free queue.

A block is *free* when no request references it (``ref_cnt == 0``). Free blocks may still hold
a cached prefix; they sit in the free queue in eviction order (least recently freed first), and
the prefix cache is told to forget a block when it is handed out again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass
class BlockPoolStats:
    num_total_blocks: int
    num_free_blocks: int
    num_cached_free_blocks: int

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / max(self.num_total_blocks, 1)


class BlockPool:
    """Owns block ids ``0 .. num_blocks - 1``."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.cached = [False] * num_blocks  # block holds a prefix the cache can find
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.on_evict: Callable[[int], None] | None = None  # set by the prefix cache

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, num: int, prefer: Sequence[int | None] = ()) -> list[int]:
        """Take ``num`` blocks from the head of the free queue (evicting cached prefixes).

        ``prefer[i]`` names a block wanted as the ``i``-th one (xTensor: already mapped where it goes);
        it is taken when it is free and holds no cached prefix, else the head of the queue is."""
        if num > len(self._free):
            raise MemoryError(f"asked for {num} KV blocks, {len(self._free)} free")
        out = []
        for i in range(num):
            want = prefer[i] if i < len(prefer) else None
            if want is not None and want in self._free and not self.cached[want]:
                del self._free[want]
                block_id = want
            else:
                block_id, _ = self._free.popitem(last=False)
            if self.cached[block_id]:
                self.cached[block_id] = False
                if self.on_evict is not None:
                    self.on_evict(block_id)
            self.ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: list[int]) -> None:
        """Add a reference to each block (prefix hit or fork); a free block leaves the free queue."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self._free[block_id]
            self.ref_cnt[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference per block. Pass blocks in eviction order (evict first first)."""
        for block_id in block_ids:
            cnt = self.ref_cnt[block_id] - 1
            if cnt < 0:
                raise RuntimeError(f"KV block {block_id} freed more often than referenced")
            self.ref_cnt[block_id] = cnt
            if cnt == 0:
                self._free[block_id] = None

    def evict_cached(self, block_id: int) -> None:
        """Mark a block as no longer holding a findable prefix (the cache dropped it)."""
        self.cached[block_id] = False

    def stats(self) -> BlockPoolStats:
        cached_free = sum(1 for b in self._free if self.cached[b])
        return BlockPoolStats(self.num_blocks, len(self._free), cached_free)
