"""The interface every KV tier implements, and the counters each keeps."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class TierStats:
    """One tier's counters (blocks and bytes since start); ``load_s`` sums the loads' wall time."""

    name: str
    capacity_blocks: int = 0  # 0: bounded by the tier itself (the store)
    num_blocks: int = 0  # held now (the store: put by this instance, as far as it knows)
    hits: int = 0  # blocks loaded from this tier
    misses: int = 0  # blocks looked up and not found (a corrupt block counts here too)
    bytes_read: int = 0
    bytes_written: int = 0
    writes: int = 0  # blocks stored
    evictions: int = 0  # blocks dropped to make room
    corrupt: int = 0  # blocks whose checksum or length did not match: dropped, never served
    errors: int = 0  # calls that failed (the store unreachable, a disk error)
    loads: int = 0  # load calls (each of one or more blocks)
    load_s: float = 0.0
    available: bool = True  # False while the tier is out (the store down): lookups miss


class KVTier(ABC):
    """A store of block records keyed by chained block hash. Called from one thread only (the tier
    worker's), so implementations need no locks."""

    name: str

    def __init__(self, record_bytes: int) -> None:
        self.record_bytes = record_bytes
        self.stats = TierStats(self.name)
        # told (tier name, keys stored, keys dropped) as they change: the cluster's index of what each
        # instance's tiers hold (``xengine/process/cluster_agent.py``)
        self.on_change: Callable[[str, list[int], list[int]], None] | None = None

    def changed(self, stored: list[int], removed: list[int]) -> None:
        if self.on_change is not None and (stored or removed):
            self.on_change(self.name, stored, removed)

    def held(self) -> list[int]:
        """Every key held (empty where the tier cannot list them: the store)."""
        return []

    @abstractmethod
    def contains(self, keys: list[int]) -> list[bool]:
        """Whether each key is held (a cheap check; a load may still miss)."""

    @abstractmethod
    def put(self, key: int, record: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """Store ``record`` (``[record_bytes]`` uint8) under ``key`` unless held already. Returns the
        records it evicted to make room, as ``(key, record)``, for a write-back policy to pass down."""

    @abstractmethod
    def _get_into(self, keys: list[int], out: torch.Tensor) -> int:
        """Load ``keys``' records into ``out[i]``; how many leading ones were loaded intact."""

    def get_into(self, keys: list[int], out: torch.Tensor) -> int:
        """Load the leading run of ``keys`` held intact into ``out`` (``[len(keys), record_bytes]``);
        returns its length."""
        t0 = time.perf_counter()
        n = self._get_into(keys, out) if keys else 0
        s = self.stats
        s.loads += 1
        s.load_s += time.perf_counter() - t0
        s.hits += n
        s.misses += len(keys) - n
        s.bytes_read += n * self.record_bytes
        return n

    def close(self) -> None:  # noqa: B027 - tiers without resources keep the default
        """Release files, memory and connections."""
