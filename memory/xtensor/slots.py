"""``SlotTable``: which virtual slot each sequence uses and which block each slot position maps.

A slot is one sequence's virtually contiguous KV range (``max_model_len`` tokens of every layer's K and
V). Slots are handed out lowest first, so running sequences stay packed and decode runs of consecutive
slots stay long. A released slot keeps its mappings (its pages become *reusable*): the next sequence
given the slot finds the positions it needs already mapped where the blocks match.
"""

from __future__ import annotations

import heapq

UNMAPPED = -1


class SlotTable:
    """With ``defer_reuse`` (async scheduling), a slot released while a step may still read it is
    handed out again only two ``next_step()`` calls later, once that step surely finished."""

    def __init__(self, slots_per_chunk: int, positions_per_slot: int, defer_reuse: bool = False) -> None:
        self.defer_reuse = defer_reuse
        self._cooling: list[int] = []  # released before the current step was prepared
        self._cooling_next: list[int] = []  # released since
        self.slots_per_chunk = slots_per_chunk
        self.positions_per_slot = positions_per_slot  # block positions in one slot
        self.slot_of: dict[str, int] = {}
        self.owner: list[str | None] = []  # per slot: the sequence using it (None: free)
        self.mapped: list[list[int]] = []  # per slot: block id mapped at each position (UNMAPPED: zero page)
        self.synced: list[int] = []  # per slot: leading positions known to match its sequence's table
        self._free: list[int] = []  # heap of free slots
        self.num_chunks = 0

    @property
    def num_slots(self) -> int:
        return len(self.mapped)

    def assign(self, seq_id: str) -> tuple[int, bool]:
        """The sequence's slot (a new one if it has none); True when a new chunk of slots was added."""
        slot = self.slot_of.get(seq_id)
        if slot is not None:
            return slot, False
        grew = not self._free
        if grew:
            first = self.num_slots
            self.mapped.extend([UNMAPPED] * self.positions_per_slot for _ in range(self.slots_per_chunk))
            self.synced.extend([0] * self.slots_per_chunk)
            self.owner.extend([None] * self.slots_per_chunk)
            self._free.extend(range(first, first + self.slots_per_chunk))
            heapq.heapify(self._free)
            self.num_chunks += 1
        slot = heapq.heappop(self._free)
        self.slot_of[seq_id] = slot
        self.owner[slot] = seq_id
        self.synced[slot] = 0
        return slot, grew

    def release(self, seq_id: str) -> int | None:
        """Give the sequence's slot back (its mappings stay); None if it had none."""
        slot = self.slot_of.pop(seq_id, None)
        if slot is not None:
            self.synced[slot] = 0
            self.owner[slot] = None
            if self.defer_reuse:
                self._cooling_next.append(slot)
            else:
                heapq.heappush(self._free, slot)
        return slot

    def next_step(self) -> None:
        """A new step is being prepared: slots released two steps ago are free again."""
        for slot in self._cooling:
            heapq.heappush(self._free, slot)
        self._cooling, self._cooling_next = self._cooling_next, []

    def is_free(self, slot: int) -> bool:
        """Unowned and not cooling (nothing may read it)."""
        return self.owner[slot] is None and slot not in self._cooling and slot not in self._cooling_next
