"""PD transfer of what a hybrid model's other layers need beside the full-attention blocks.

A prompt exported for a hybrid model carries, next to its full-attention blocks
(``kv_transfer.py``):

- for the sliding-window layers (``memory/sliding_window.py``), only the window blocks a query after
  the exported prefix reads: ``ceil((window - 1) / block_size)`` blocks or so, whatever the prompt's
  length. The importer maps them to its own full-attention blocks at the same positions, so its
  window-safe prefix check accepts the hit;
- for the recurrent layers (``memory/recurrent_state.py``), the state snapshot at the exported
  prefix's end, copied whole into a snapshot slot of the importer keyed by its last block.

The exported length is therefore the one every kind can resume from (``usable_prefix``). Both sides
register these tensors with the transfer agent and pin what they hand out until the pin is released
(the exporter) or the request is admitted (the importer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from memory.recurrent_state import RecurrentStateSlots
from memory.sliding_window import NULL_BLOCK, SlidingWindowBlocks
from memory.transfer import ExtraKV, KVRegion, KVTransferAgent, block_ranges
from xengine.api.messages import StateExportMsg, WindowExportMsg


@dataclass
class HybridPin:
    """What a pin holds beyond full-attention blocks."""

    window_blocks: list[int] = field(default_factory=list)
    state_slot: int | None = None


@dataclass
class HybridReadStats:
    num_window_blocks: int = 0
    num_window_bytes: int = 0
    num_state_bytes: int = 0


class WindowTransfer(ExtraKV):
    """The sliding-window pool's side of an export / import."""

    def __init__(self, window: SlidingWindowBlocks, caches: list[torch.Tensor]) -> None:
        super().__init__(caches)  # the window layers' tensors
        self.window = window

    def export(self, session: str, full_blocks: list[int]) -> tuple[WindowExportMsg, list[int]]:
        """Describe (and pin) the window blocks a query after ``full_blocks`` reads."""
        k = len(full_blocks)
        first = self.window.first_needed(k * self.window.block_size)
        blocks = [self.window.by_full[b] for b in full_blocks[first:k]]
        self.window.pool.touch(blocks)
        region = self.region(session)
        msg = WindowExportMsg(
            layer_addrs=list(region.layer_addrs),
            num_blocks=region.num_blocks,
            block_bytes=region.block_bytes,
            window=self.window.window,
            first=first,
            block_ids=blocks,
        )
        return msg, blocks

    def import_(
        self, agent: KVTransferAgent, session: str, source: WindowExportMsg, local_full: list[int]
    ) -> tuple[list[int], HybridReadStats]:
        """Read the window blocks this side lacks for ``local_full`` (the importer's full blocks of the
        prefix) and map them; returns the window blocks to pin and what moved."""
        mine = self.region(agent.region.session)
        if (source.block_bytes, len(source.layer_addrs), source.window) != (
            mine.block_bytes,
            len(mine.layer_addrs),
            self.window.window,
        ):
            raise ValueError(
                "sliding-window KV layouts of the prefill and decode instances differ (block bytes, "
                "window layers, window); run both with the same model, dtype and cache settings"
            )
        pairs, pinned, mapping = [], [], []
        for j, src in enumerate(source.block_ids):
            full = local_full[source.first + j]
            have = self.window.by_full.get(full)
            if have is not None:
                self.window.pool.touch([have])
                pinned.append(have)
                continue
            if self.window.pool.num_free_blocks == 0:
                break  # the rest is recomputed (the hit is shortened where its window is missing)
            dst = self.window.pool.allocate(1)[0]
            pairs.append((src, dst))
            pinned.append(dst)
            mapping.append((full, dst))
        peer = KVRegion(session, list(source.layer_addrs), source.num_blocks, source.block_bytes)
        src, dst, lengths = block_ranges(peer, mine, pairs) if pairs else ([], [], [])
        try:
            agent.read_ranges(session, src, dst, lengths)
        except BaseException:
            self.release(pinned)
            raise
        for full, block in mapping:
            self.window.map_cached(full, block)
        return pinned, HybridReadStats(num_window_blocks=len(pairs), num_window_bytes=sum(lengths))

    def release(self, blocks: list[int]) -> None:
        live = [b for b in blocks if b != NULL_BLOCK]
        if live:
            self.window.pool.free(list(reversed(live)))


class StateTransfer:
    """The recurrent state pool's side: one snapshot, copied whole."""

    def __init__(self, slots: RecurrentStateSlots, tensors: list[torch.Tensor]) -> None:
        self.slots = slots
        self.tensors = tensors  # every recurrent layer's state tensors ``[num_slots, ...]``
        self.addrs: list[int] = []

    def register(self, agent: KVTransferAgent) -> None:
        if not self.addrs:
            self.addrs = [agent.register_buffer(t) for t in self.tensors]

    def _slot_bytes(self) -> list[int]:
        return [t[0].nbytes for t in self.tensors]

    def export(self, last_block: int) -> StateExportMsg:
        """Describe (and pin) the snapshot keyed by the exported prefix's last block."""
        slot = self.slots.by_block[last_block]
        self.slots.pin(slot)
        return StateExportMsg(tensor_addrs=list(self.addrs), slot_bytes=self._slot_bytes(), slot=slot)

    def import_(
        self, agent: KVTransferAgent, session: str, source: StateExportMsg, local_last: int
    ) -> tuple[int | None, HybridReadStats]:
        """Copy the snapshot into a slot keyed by ``local_last`` (unless one is there); the slot to pin."""
        if source.slot_bytes != self._slot_bytes():
            raise ValueError(
                "recurrent state layouts of the prefill and decode instances differ; run both with the "
                "same model and dtype"
            )
        have = self.slots.by_block.get(local_last)
        if have is not None:
            self.slots.pin(have)
            return have, HybridReadStats()
        slot = self.slots.take_snapshot_slot()
        if slot is None:
            return None, HybridReadStats()  # no room: the hit is shortened to an earlier snapshot
        src = [a + source.slot * n for a, n in zip(source.tensor_addrs, source.slot_bytes)]
        dst = [a + slot * n for a, n in zip(self.addrs, source.slot_bytes)]
        try:
            agent.read_ranges(session, src, dst, list(source.slot_bytes))
        except BaseException:
            self.slots.give_back(slot)
            raise
        self.slots.key(local_last, slot)
        self.slots.pin(slot)
        return slot, HybridReadStats(num_state_bytes=sum(source.slot_bytes))

    def release(self, slot: int | None) -> None:
        if slot is not None:
            self.slots.unpin(slot)
