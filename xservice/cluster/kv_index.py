"""Global prefix index: which instance holds which KV block, by chained block hash.

A block's hash chains its parent's: ``h_i = H(h_{i-1}, tokens of block i)`` with ``h_{-1} = 0``,
so one hash names a whole prefix and the service can match a prompt without token ids from the
engines. Both sides use the one definition in ``xengine/api/block_hash.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from xengine.api.block_hash import block_hash, prompt_block_hashes

__all__ = ["GlobalKVIndex", "TierKVIndex", "block_hash", "prompt_block_hashes"]


class GlobalKVIndex:
    """hash -> instances holding it, plus each instance's set (to drop it at once)."""

    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        self._by_instance: dict[str, set[int]] = {}

    def add(self, name: str, hashes: Iterable[int]) -> None:
        mine = self._by_instance.setdefault(name, set())
        for h in hashes:
            mine.add(h)
            self._holders.setdefault(h, set()).add(name)

    def remove(self, name: str, hashes: Iterable[int]) -> None:
        mine = self._by_instance.get(name, set())
        for h in hashes:
            mine.discard(h)
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(name)
                if not holders:
                    del self._holders[h]

    def replace(self, name: str, hashes: Iterable[int]) -> None:
        self.drop(name)
        self.add(name, hashes)

    def drop(self, name: str) -> None:
        self.remove(name, list(self._by_instance.pop(name, ())))

    def held_by(self, name: str) -> set[int]:
        """The instance's set itself (read only)."""
        return self._by_instance.get(name, set())

    def hashes_of(self, name: str) -> set[int]:
        return set(self._by_instance.get(name, ()))

    def num_blocks(self, name: str) -> int:
        return len(self._by_instance.get(name, ()))

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Per instance, how many leading blocks of ``hashes`` it holds."""
        matched: dict[str, int] = {}
        alive: set[str] | None = None
        for i, h in enumerate(hashes):
            holders = self._holders.get(h)
            alive = set(holders or ()) if alive is None else alive & (holders or set())
            if not alive:
                break
            for name in alive:
                matched[name] = i + 1
        return matched


class TierKVIndex:
    """What the KV tiers behind the instances' prefix caches hold (``docs/kv_tiers.md``): per instance its
    host (L2) and disk (L3) tiers, and the cluster's Mooncake Store (L3, shared: a block any instance
    wrote there is every store-connected instance's to load; the store tells no evictions, so the
    newest ``MAX_STORE_BLOCKS`` written are taken as held)."""

    LOCAL = ("host", "disk")
    MAX_STORE_BLOCKS = 1 << 20

    def __init__(self) -> None:
        self.local = {tier: GlobalKVIndex() for tier in self.LOCAL}
        self.store: dict[int, None] = {}

    def apply(
        self, name: str, full: bool, stored: dict[str, list[int]], removed: dict[str, list[int]]
    ) -> None:
        for tier, index in self.local.items():
            if full:
                index.replace(name, stored.get(tier, ()))
            else:
                index.remove(name, removed.get(tier, ()))
                index.add(name, stored.get(tier, ()))
        if "store" in stored:
            for h in stored["store"]:
                self.store.pop(h, None)
                self.store[h] = None
            while len(self.store) > self.MAX_STORE_BLOCKS:
                self.store.pop(next(iter(self.store)))

    def counts(self, name: str) -> dict[str, int]:
        """Blocks the instance's local tiers hold, per tier."""
        return {tier: index.num_blocks(name) for tier, index in self.local.items()}

    def drop(self, name: str) -> None:
        for index in self.local.values():
            index.drop(name)

    def match(
        self, hashes: Sequence[int], l1: Mapping[str, int], names: Iterable[str], store_users: set[str]
    ) -> dict[str, tuple[int, int]]:
        """Per instance of ``names``: leading blocks of ``hashes`` it holds in L1 or L2, and in any tier
        (L1, L2, its disk, the store if it is one of ``store_users``); ``l1``: its L1 match
        (``GlobalKVIndex.match``)."""
        out = {}
        for name in names:
            upto_l2 = self._run(hashes, l1.get(name, 0), name, ("host",), store=False)
            upto_l3 = self._run(hashes, upto_l2, name, ("host", "disk"), store=name in store_users)
            out[name] = (upto_l2, upto_l3)
        return out

    def _run(self, hashes: Sequence[int], start: int, name: str, tiers: tuple[str, ...], store: bool) -> int:
        """How far the leading run continues past ``start`` through ``name``'s ``tiers`` (and the store)."""
        held = [self.local[t].held_by(name) for t in tiers]
        n = start
        while n < len(hashes):
            h = hashes[n]
            if not (any(h in s for s in held) or (store and h in self.store)):
                break
            n += 1
        return n
