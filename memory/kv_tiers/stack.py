"""The tiers in order (L2 host, then L3: disk and the store) and the write policy over them.

- ``write_through``: a block is written to every tier as soon as the prefix cache holds it (so another
  instance, or the request migrated off this one, finds it at once).
- ``write_back``: a block goes to L2 when L1 evicts it, and to L3 when L2 evicts it (least traffic; a
  killed instance's blocks still in L1 are lost).
- ``selective``: write-through for blocks hit at least ``write_min_hits`` times (the engine side
  counts hits and asks for the save).

Loads take each block from the first tier holding it; a block loaded from L3 is promoted into L2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memory.kv_tiers.base import KVTier, TierStats
from memory.kv_tiers.host import HostTier
from memory.kv_tiers.store import StoreTier

WRITE_POLICIES = ("write_through", "write_back", "selective")


@dataclass
class Probe:
    """Which tier holds each of the leading keys found (index into ``TierStack.tiers``)."""

    tiers: list[int]

    @property
    def num_blocks(self) -> int:
        return len(self.tiers)


class TierStack:
    def __init__(self, tiers: list[KVTier], write_policy: str = "write_through") -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"kv_tiers.write_policy must be one of {', '.join(WRITE_POLICIES)}")
        self.tiers = tiers
        self.write_policy = write_policy
        self.host = next((t for t in tiers if isinstance(t, HostTier)), None)
        self.lower = [t for t in tiers if t is not self.host]  # L3

    def stats(self) -> list[TierStats]:
        return [t.stats for t in self.tiers]

    # ------------------------------------------------------------------ writes
    def save(self, keys: list[int], records: torch.Tensor) -> None:
        """Blocks the prefix cache just stored (write-through, selective) or L1 evicted (write-back)."""
        if self.write_policy == "write_back" and self.host is not None:
            for i, key in enumerate(keys):
                for old, record in self.host.put(key, records[i]):
                    self._put_lower([old], record.view(1, -1))
            return
        if self.host is not None:
            for i, key in enumerate(keys):
                self.host.put(key, records[i])
        self._put_lower(keys, records)

    def _put_lower(self, keys: list[int], records: torch.Tensor) -> None:
        for tier in self.lower:
            held = tier.contains(keys)
            new = [i for i, h in enumerate(held) if not h]
            if not new:
                continue
            if isinstance(tier, StoreTier):
                idx = torch.tensor(new, dtype=torch.long)
                tier.put_many([keys[i] for i in new], records.index_select(0, idx))
            else:
                for i in new:
                    tier.put(keys[i], records[i])

    # ------------------------------------------------------------------ reads
    def probe(self, keys: list[int]) -> Probe:
        """The leading run of ``keys`` some tier holds, and which (local tiers asked first)."""
        where: list[int | None] = [None] * len(keys)
        for t, tier in enumerate(self.tiers):
            first = next((i for i, w in enumerate(where) if w is None), None)
            if first is None:
                break
            for i, held in enumerate(tier.contains(keys[first:]), start=first):
                if held and where[i] is None:
                    where[i] = t
        run = next((i for i, w in enumerate(where) if w is None), len(keys))
        return Probe([w for w in where[:run] if w is not None])

    def held(self, keys: list[int]) -> list[bool]:
        """Whether some tier holds each of ``keys`` (not only a leading run)."""
        found = [False] * len(keys)
        for tier in self.tiers:
            left = [i for i, f in enumerate(found) if not f]
            if not left:
                break
            for i, h in zip(left, tier.contains([keys[i] for i in left])):
                found[i] = h
        return found

    def load(self, keys: list[int], probe: Probe, out: torch.Tensor) -> int:
        """Load the probed run into ``out``; how many leading blocks arrived intact."""
        done, lower = 0, []
        while done < probe.num_blocks:
            t = probe.tiers[done]
            end = next((i for i in range(done, probe.num_blocks) if probe.tiers[i] != t), probe.num_blocks)
            tier = self.tiers[t]
            got = tier.get_into(keys[done:end], out[done:end])
            if tier is not self.host:
                lower.extend(range(done, done + got))
            done += got
            if done < end:
                break
        if self.host is not None:  # promoted once the run is in (not to evict a host block it reads)
            for i in lower:
                for old, record in self.host.put(keys[i], out[i]):
                    if self.write_policy == "write_back":  # L2 is the only copy: pass it down
                        self._put_lower([old], record.view(1, -1))
        return done

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
