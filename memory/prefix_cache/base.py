"""The prefix-cache interface the KV cache manager programs against."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass
class PrefixMatch:
    block_ids: list[int]  # cached blocks covering the first len(block_ids) * block_size tokens

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


class BasePrefixCache(ABC):
    """Maps token prefixes (whole blocks) to KV blocks.

    - ``match(tokens)``: longest cached run of whole blocks that is a prefix of ``tokens``.
    - ``insert(tokens, block_ids)``: record that ``block_ids[i]`` holds block ``i`` of ``tokens``.
    - ``lock(block_ids)`` / ``unlock``: pin matched blocks while a request uses them (ref counts).
    - ``evict(block_id)``: forget a block (its memory is being reused), with its descendants.
    """

    @abstractmethod
    def match(self, token_ids: list[int], max_blocks: int | None = None) -> PrefixMatch: ...

    @abstractmethod
    def insert(self, token_ids: list[int], block_ids: list[int], num_cached_blocks: int = 0) -> int: ...

    @abstractmethod
    def lock(self, block_ids: list[int]) -> None: ...

    @abstractmethod
    def unlock(self, block_ids: list[int]) -> None: ...

    @abstractmethod
    def evict(self, block_id: int) -> None: ...

    @abstractmethod
    def reset(self) -> bool: ...

    @property
    @abstractmethod
    def num_cached_blocks(self) -> int: ...
