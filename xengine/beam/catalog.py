"""Item catalogs for generative recommendation: valid items as a trie of token ids.

An item is a fixed-length tuple of token ids (OneRec-style semantic ids). Constrained beam search
asks the trie, at each of the item's ``item_len`` steps, which tokens continue a valid prefix of a
beam; every other token's logprob is set to -inf before selection, so only catalog items come out.
"""

from __future__ import annotations

import re

import numpy as np

from xengine.api.messages import MAX_CATALOG_NAME_LEN, CatalogInfo

MAX_CATALOG_ITEMS = 200_000
MAX_ITEM_LEN = 16
MAX_CATALOGS = 64
_NAME_RE = re.compile(rf"^[A-Za-z0-9_.:-]{{1,{MAX_CATALOG_NAME_LEN}}}$")


class TrieNode:
    __slots__ = ("children", "child_ids")

    def __init__(self) -> None:
        self.children: dict[int, TrieNode] = {}
        self.child_ids: np.ndarray = np.empty(0, dtype=np.int64)  # sorted; set by ``freeze``


class ItemCatalog:
    """A validated, immutable set of items of one length, stored as a trie."""

    def __init__(self, name: str, items: list[list[int]], vocab_size: int) -> None:
        validate_catalog(name, items, vocab_size)
        self.name = name
        self.item_len = len(items[0])
        self.root = TrieNode()
        self.num_nodes = 1
        self.num_items = 0  # distinct items, counted by ``_freeze`` (duplicates collapse in the trie)
        for item in items:
            self._insert(item)
        self._freeze(self.root)

    def _insert(self, item: list[int]) -> None:
        node = self.root
        for token_id in item:
            child = node.children.get(token_id)
            if child is None:
                child = node.children[token_id] = TrieNode()
                self.num_nodes += 1
            node = child

    def _freeze(self, root: TrieNode) -> None:
        stack = [(root, 0)]
        num_leaves = 0
        while stack:
            node, depth = stack.pop()
            node.child_ids = np.array(sorted(node.children), dtype=np.int64)
            if depth == self.item_len:
                num_leaves += 1
            stack.extend((child, depth + 1) for child in node.children.values())
        self.num_items = num_leaves

    def allowed_token_ids(self, prefix: list[int]) -> np.ndarray:
        """Sorted ids that extend ``prefix`` (a valid item prefix) towards an item; empty if none."""
        node = self.root
        for token_id in prefix:
            nxt = node.children.get(token_id)
            if nxt is None:
                return np.empty(0, dtype=np.int64)
            node = nxt
        return node.child_ids

    def contains(self, item: list[int]) -> bool:
        node: TrieNode | None = self.root
        for token_id in item:
            node = node.children.get(token_id) if node is not None else None
        return node is not None and len(item) == self.item_len

    def info(self) -> CatalogInfo:
        return CatalogInfo(
            name=self.name, num_items=self.num_items, item_len=self.item_len, num_nodes=self.num_nodes
        )


def validate_catalog(name: str, items: list[list[int]], vocab_size: int) -> None:
    """Raise ``ValueError`` ("invalid value for '<field>': ...") unless the catalog is well formed."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"invalid value for 'name': must be 1..{MAX_CATALOG_NAME_LEN} characters of [A-Za-z0-9_.:-]"
        )
    if not items:
        raise ValueError("invalid value for 'items': the catalog is empty")
    if len(items) > MAX_CATALOG_ITEMS:
        raise ValueError(f"invalid value for 'items': at most {MAX_CATALOG_ITEMS} items, got {len(items)}")
    item_len = len(items[0])
    if not 1 <= item_len <= MAX_ITEM_LEN:
        raise ValueError(f"invalid value for 'items': each item must have 1..{MAX_ITEM_LEN} token ids")
    for i, item in enumerate(items):
        if len(item) != item_len:
            raise ValueError(
                f"invalid value for 'items': item {i} has {len(item)} token ids, item 0 has {item_len} "
                "(all items of a catalog have the same length)"
            )
        for t in item:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
                raise ValueError(
                    f"invalid value for 'items': item {i} has token id {t!r} outside the vocabulary "
                    f"[0, {vocab_size})"
                )


class CatalogRegistry:
    """The engine's catalogs by name (registering a name again replaces it)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.catalogs: dict[str, ItemCatalog] = {}

    def register(self, name: str, items: list[list[int]]) -> CatalogInfo:
        if name not in self.catalogs and len(self.catalogs) >= MAX_CATALOGS:
            raise ValueError(f"invalid value for 'name': at most {MAX_CATALOGS} catalogs can be registered")
        catalog = ItemCatalog(name, items, self.vocab_size)
        self.catalogs[name] = catalog
        return catalog.info()

    def get(self, name: str) -> ItemCatalog | None:
        return self.catalogs.get(name)

    def list(self) -> list[CatalogInfo]:
        return [c.info() for c in self.catalogs.values()]
