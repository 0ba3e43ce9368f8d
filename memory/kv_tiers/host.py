"""L2: a host-memory arena of block records with least-recently-used eviction.

Pinned host memory where the platform has a device to copy from (CUDA / NPU: copies to and from the KV
pool run asynchronously); plain memory on CPU, where it is a budget of its own beside the KV pool.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from memory.kv_tiers.base import KVTier


class HostTier(KVTier):
    name = "host"

    def __init__(self, record_bytes: int, capacity_blocks: int, pin_memory: bool = False) -> None:
        super().__init__(record_bytes)
        if capacity_blocks < 1:
            raise ValueError("the host KV tier needs room for at least one block")
        self.arena = torch.empty((capacity_blocks, record_bytes), dtype=torch.uint8, pin_memory=pin_memory)
        self._slots: OrderedDict[int, int] = OrderedDict()  # key -> slot, least recently used first
        self._free = list(range(capacity_blocks - 1, -1, -1))
        self.stats.capacity_blocks = capacity_blocks

    def contains(self, keys: list[int]) -> list[bool]:
        return [k in self._slots for k in keys]

    def put(self, key: int, record: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        if key in self._slots:
            self._slots.move_to_end(key)
            return []
        evicted: list[tuple[int, torch.Tensor]] = []
        if self._free:
            slot = self._free.pop()
        else:
            old, slot = self._slots.popitem(last=False)
            evicted.append((old, self.arena[slot].clone()))
            self.stats.evictions += 1
        self.arena[slot].copy_(record)
        self._slots[key] = slot
        self.stats.writes += 1
        self.stats.bytes_written += self.record_bytes
        self.stats.num_blocks = len(self._slots)
        self.changed([key], [old for old, _ in evicted])
        return evicted

    def _get_into(self, keys: list[int], out: torch.Tensor) -> int:
        for i, key in enumerate(keys):
            slot = self._slots.get(key)
            if slot is None:
                return i
            self._slots.move_to_end(key)
            out[i].copy_(self.arena[slot])
        return len(keys)

    def held(self) -> list[int]:
        return list(self._slots)

    def get_view(self, key: int) -> torch.Tensor | None:
        """The record held for ``key`` in place (valid until the next ``put``), or None."""
        slot = self._slots.get(key)
        return None if slot is None else self.arena[slot]
