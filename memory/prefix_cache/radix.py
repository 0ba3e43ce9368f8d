"""Radix-tree prefix cache over whole KV blocks.

Each tree node is one full block: its edge key is the block's ``block_size`` token ids, so a
path from the root spells a token prefix. Nodes hold no references: a cached block whose
ref count drops to zero waits in the pool's free queue (LRU), and when the pool hands it out
again it calls ``evict`` here, which drops the node and its subtree.

An optional ``event_sink(stored, removed)`` receives the chained block hashes of nodes as they are
inserted and dropped, for a cluster agent to publish (KV-cache events). The hash is the wire one
the service's prefix index matches prompts with (``xengine/api/block_hash.py``; ``docs/cluster.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from memory.block_pool import BlockPool
from memory.prefix_cache.base import BasePrefixCache, PrefixMatch
from xengine.api.block_hash import block_hash

KVEventSink = Callable[[list[int], list[int]], None]
TierHook = Callable[[list[int], list[int]], None]


@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]
    block_id: int
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    hash: int = 0  # chained block hash, computed only when an event sink is set


class RadixPrefixCache(BasePrefixCache):
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.root = _Node(key=(), block_id=-1, parent=None)
        self._by_block: dict[int, _Node] = {}
        self.event_sink: KVEventSink | None = None
        # told the block ids of every node dropped (evicted with its subtree, or reset): state kept
        # beside cached blocks (a sliding-window pool's blocks, ``memory/sliding_window.py``) goes too
        self.forget_sink: Callable[[list[int]], None] | None = None
        # KV tiers (``xengine/tiered_kv.py``): told ``(hashes, block_ids)`` of nodes as they are stored,
        # and of nodes about to be dropped while their blocks still hold the KV (write-back)
        self.stored_hook: TierHook | None = None
        self.evict_hook: TierHook | None = None
        pool.on_evict = self.evict

    @property
    def _hashing(self) -> bool:
        return self.event_sink is not None or self.stored_hook is not None or self.evict_hook is not None

    def _chunks(self, token_ids: list[int], num_blocks: int) -> list[tuple[int, ...]]:
        bs = self.block_size
        return [tuple(token_ids[i * bs : (i + 1) * bs]) for i in range(num_blocks)]

    def match(self, token_ids: list[int], max_blocks: int | None = None) -> PrefixMatch:
        num_blocks = len(token_ids) // self.block_size
        if max_blocks is not None:
            num_blocks = min(num_blocks, max_blocks)
        node, out = self.root, []
        for key in self._chunks(token_ids, num_blocks):
            node = node.children.get(key)
            if node is None:
                break
            out.append(node.block_id)
        return PrefixMatch(out)

    def insert(self, token_ids: list[int], block_ids: list[int], num_cached_blocks: int = 0) -> int:
        """Insert the first ``len(block_ids)`` full blocks; returns how many new nodes were made.

        A block whose prefix is already cached under another block id is left uncached (it is
        freed normally); the existing node wins so other requests keep sharing it.
        """
        node, added, stored, blocks = self.root, 0, [], []
        for i, key in enumerate(self._chunks(token_ids, len(block_ids))):
            child = node.children.get(key)
            if child is None:
                if self.pool.cached[block_ids[i]]:
                    # block already findable elsewhere (must not happen) - stop to stay consistent
                    break
                child = _Node(key=key, block_id=block_ids[i], parent=node)
                node.children[key] = child
                self._by_block[block_ids[i]] = child
                self.pool.cached[block_ids[i]] = True
                added += 1
                if self._hashing:
                    child.hash = block_hash(node.hash, key)
                    stored.append(child.hash)
                    blocks.append(block_ids[i])
            node = child
        if stored and self.event_sink is not None:
            self.event_sink(stored, [])
        if stored and self.stored_hook is not None:
            self.stored_hook(stored, blocks)
        return added

    def lock(self, block_ids: list[int]) -> None:
        self.pool.touch(block_ids)

    def unlock(self, block_ids: list[int]) -> None:
        self.pool.free(block_ids)

    def evict(self, block_id: int) -> None:
        node = self._by_block.pop(block_id, None)
        if node is None:
            return
        if node.parent is not None:
            node.parent.children.pop(node.key, None)
        removed, blocks = [node.hash], [block_id]
        stack = list(node.children.values())
        while stack:  # descendants become unreachable: forget them too
            child = stack.pop()
            removed.append(child.hash)
            blocks.append(child.block_id)
            self._by_block.pop(child.block_id, None)
            self.pool.evict_cached(child.block_id)
            stack.extend(child.children.values())
        self.pool.evict_cached(block_id)
        if self.evict_hook is not None:
            self.evict_hook(removed, blocks)
        if self.event_sink is not None:
            self.event_sink([], removed)
        if self.forget_sink is not None:
            self.forget_sink(blocks)

    def reset(self) -> bool:
        """Forget every cached prefix. Refused (False) while blocks are referenced."""
        if any(self.pool.ref_cnt[b] > 0 for b in self._by_block):
            return False
        for block_id in list(self._by_block):
            self.pool.evict_cached(block_id)
        if self.event_sink is not None and self._by_block:
            self.event_sink([], [n.hash for n in self._by_block.values()])
        if self.forget_sink is not None and self._by_block:
            self.forget_sink(list(self._by_block))
        self._by_block.clear()
        self.root.children.clear()
        return True

    def path_of(self, block_id: int) -> list[int]:
        """The cached blocks from the root through ``block_id`` (empty: not cached)."""
        node, path = self._by_block.get(block_id), []
        while node is not None and node.parent is not None:
            path.append(node.block_id)
            node = node.parent
        return path[::-1]

    def hash_of(self, block_id: int) -> int | None:
        """The chained hash of the node holding ``block_id`` (None: not cached, or nothing hashes)."""
        node = self._by_block.get(block_id)
        return node.hash if node is not None and self._hashing else None

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_block)
