"""Global prefix index: which instance holds which KV block, by chained block hash.

A block's hash chains its parent's: ``h_i = H(h_{i-1}, tokens of block i)`` with ``h_{-1} = 0``,
so one hash names a whole prefix and the service can match a prompt without token ids from the
engines. Both sides use the one definition in ``xengine/api/block_hash.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from xengine.api.block_hash import block_hash, prompt_block_hashes

__all__ = ["GlobalKVIndex", "block_hash", "prompt_block_hashes"]


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
