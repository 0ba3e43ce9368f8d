"""``XTensorKVLayout``: KV that is logically contiguous per sequence and physically paged (xLLM §4.3).

Pages come from the platform's VMM, one per (layer, K or V, block). Two virtual views share them: the
**paged view** maps every page once, in order, so it is byte for byte ``PagedKVLayout``'s tensor and
everything block-based (K/V writes by slot, copy-on-write, PD transfer) works unchanged; **slots**
give each running sequence a ``max_model_len`` range per layer and K/V whose position ``j`` maps the
page of its ``j``-th block, so attention reads the context in place. Mapping is on demand and kept
after a sequence finishes (the next one in the slot is steered to the same blocks), so a steady stream
of requests maps nothing. See ``docs/xtensor.md``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable

import torch

from memory.kv_layout import KVCacheSpec, PagedKVLayout
from memory.xtensor.mapper import MapCall, PageMapper
from memory.xtensor.pages import PageState, XTensorStats, page_state
from memory.xtensor.slots import UNMAPPED, SlotTable
from ops.attention_metadata import ContiguousKV
from ops.platforms.vmm import BaseVMM, PhysicalPages, VirtualRange


class XTensorKVLayout(PagedKVLayout):
    def __init__(
        self, vmm: BaseVMM, max_model_len: int, slots_per_chunk: int = 64, defer_slot_reuse: bool = False
    ) -> None:
        """``defer_slot_reuse``: async scheduling, where a step may still read a slot released while
        the next one is scheduled: such a slot is not remapped until that step finished."""
        self.vmm = vmm
        self.defer_slot_reuse = defer_slot_reuse
        self.max_model_len = max_model_len
        self.slots_per_chunk = slots_per_chunk
        self.mapper = PageMapper()
        weakref.finalize(self, self.mapper.stop)  # a layout dropped unclosed ends its thread too
        self.num_maps = 0
        self.num_unmaps = 0
        self._chunks: list[VirtualRange] = []
        self.caches: list[ContiguousKV] = []

    # ------------------------------------------------------------------ memory

    def allocate(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
        self.spec, self.num_blocks = spec, num_blocks
        self.token_bytes = spec.token_bytes
        self.page_bytes = spec.block_size * self.token_bytes
        if self.page_bytes % self.vmm.granularity:
            raise ValueError(
                f"xTensor pages must be multiples of the device page ({self.vmm.granularity} bytes), but one block "
                f"of one layer's K is {self.page_bytes} bytes; raise cache.block_size or leave it unset "
                "(xTensor then picks one that fits)"
            )
        self.num_streams = 2 * spec.num_layers  # (layer, K/V) pairs
        self.positions = -(-self.max_model_len // spec.block_size)  # block positions of one slot
        self.slot_bytes = self.positions * self.page_bytes
        self._budget = self._mapping_budget(num_blocks)
        self.pages: PhysicalPages = self.vmm.create_pages(self.num_streams * num_blocks, self.page_bytes)
        self._flat = self.vmm.reserve(self.num_streams * num_blocks * self.page_bytes)
        self.vmm.map(self._flat, 0, self.pages, 0, self.num_streams * num_blocks)
        flat = self.vmm.tensor(self._flat, spec.storage_dtype)
        per_layer = flat.numel() // spec.num_layers
        shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.row_width)
        kv_caches = [flat[i * per_layer : (i + 1) * per_layer].view(shape) for i in range(spec.num_layers)]
        self.caches = [ContiguousKV(c, [], [], self.slots_per_chunk) for c in kv_caches]
        self.slots = SlotTable(self.slots_per_chunk, self.positions, self.defer_slot_reuse)
        self.num_mappings = [0] * num_blocks  # slot positions mapping each block
        self.num_live_mappings = 0
        return kv_caches

    def _mapping_budget(self, num_blocks: int) -> int | None:
        """Most (slot, position) mappings we may hold: each is ``num_streams`` mapped regions."""
        regions = self.vmm.mapping_budget()
        if regions is None:
            return None
        budget = regions // self.num_streams
        if budget < num_blocks:
            raise ValueError(
                f"xTensor: {num_blocks} KV blocks x {self.num_streams} layer K/V streams need up to "
                f"{num_blocks * self.num_streams} memory mappings, more than this process may hold "
                f"({regions} left under vm.max_map_count); raise cache.block_size, lower the KV pool "
                f"(cache.num_blocks / kv_cache_memory_gb) or raise vm.max_map_count "
                f"(sysctl -w vm.max_map_count={2 * (num_blocks * self.num_streams * 2 + 65536)})"
            )
        return budget

    def _add_chunk(self) -> None:
        per_chunk = self.slots_per_chunk
        vrange = self.vmm.reserve(self.num_streams * per_chunk * self.slot_bytes)
        self._chunks.append(vrange)
        chunk = self.vmm.tensor(vrange, self.spec.storage_dtype)
        stream_elems = chunk.numel() // self.num_streams
        shape = (
            per_chunk,
            self.positions * self.spec.block_size,
            self.spec.num_kv_heads,
            self.spec.row_width,
        )
        for layer, cache in enumerate(self.caches):
            k, v = (
                chunk[(2 * layer + i) * stream_elems : (2 * layer + i + 1) * stream_elems] for i in (0, 1)
            )
            cache.k_chunks.append(k.view(shape))
            cache.v_chunks.append(v.view(shape))

    def attention_caches(self, kv_caches: list[torch.Tensor]) -> list[ContiguousKV]:
        return self.caches

    # ------------------------------------------------------------------ placement (KVCacheManager)

    def preferred_blocks(self, seq_id: str, first: int, count: int) -> list[int | None]:
        """Blocks already mapped at positions ``first ..`` of the sequence's slot (None: no preference)."""
        slot = self._slot(seq_id)
        mapped = self.slots.mapped[slot]
        return [
            mapped[j] if 0 <= j < self.positions and mapped[j] != UNMAPPED else None
            for j in range(first, first + count)
        ]

    def released(self, seq_id: str) -> None:
        """The sequence freed its blocks: its slot (and the slot's mappings) wait for the next one."""
        self.slots.release(seq_id)

    def _slot(self, seq_id: str) -> int:
        slot, grew = self.slots.assign(seq_id)
        if grew:
            self._add_chunk()
        return slot

    # ------------------------------------------------------------------ per step

    def prepare(self, seqs: Iterable[tuple[str, list[int], int]]) -> list[int]:
        """Map what ``(seq_id, block table, tokens this step covers)`` need; returns each one's slot.

        Pages the step reads are mapped before this returns; pages past them (look-ahead blocks) are
        mapped on the mapper thread while the step runs."""
        self.mapper.wait()  # the previous step's look-ahead
        self.slots.next_step()
        now: list[MapCall] = []
        ahead: list[MapCall] = []
        slots = []
        for seq_id, table, num_tokens in seqs:
            slot = self._slot(seq_id)
            slots.append(slot)
            self._sync(slot, table, -(-num_tokens // self.spec.block_size), now, ahead)
        self.mapper.submit(now)
        self.mapper.wait()
        self.mapper.submit(ahead)
        return slots

    def _sync(
        self, slot: int, table: list[int], needed: int, now: list[MapCall], ahead: list[MapCall]
    ) -> None:
        """Queue the maps that make the slot's positions match ``table`` (``needed`` first ones: now)."""
        mapped = self.slots.mapped[slot]
        synced = self.slots.synced[slot]
        if synced > len(table) or mapped[:synced] != table[:synced]:
            synced = 0  # the table changed under us (never expected; stay correct anyway)
        if needed > self.positions:
            raise ValueError(f"a sequence needs {needed} blocks, its slot has {self.positions}")
        table = table[: self.positions]  # a look-ahead block past max_model_len is never read
        j = synced
        while j < len(table):
            if mapped[j] == table[j]:
                j += 1
                continue
            start, first_block = j, table[j]
            while (
                j < len(table)
                and mapped[j] != table[j]
                and table[j] == first_block + (j - start)
                and not (j == needed and start < needed)
            ):
                self._set(mapped, j, table[j])
                j += 1
            (now if start < needed else ahead).append(
                functools.partial(self._map_run, slot, start, first_block, j - start)
            )
        self.slots.synced[slot] = len(table)

    def _set(self, mapped: list[int], j: int, block: int) -> None:
        old = mapped[j]
        if old == UNMAPPED:
            self.num_live_mappings += 1
            if self._budget is not None and self.num_live_mappings > self._budget:
                self._evict_stale()
        else:
            self.num_mappings[old] -= 1
        mapped[j] = block
        self.num_mappings[block] += 1
        self.num_maps += 1

    def _stream_offset(self, slot: int, stream: int, position: int) -> tuple[VirtualRange, int]:
        chunk, row = divmod(slot, self.slots_per_chunk)
        return self._chunks[chunk], (
            stream * self.slots_per_chunk + row
        ) * self.slot_bytes + position * self.page_bytes

    def _map_run(self, slot: int, position: int, first_block: int, count: int) -> None:
        for stream in range(self.num_streams):
            vrange, offset = self._stream_offset(slot, stream, position)
            self.vmm.map(vrange, offset, self.pages, stream * self.num_blocks + first_block, count)

    # ------------------------------------------------------------------ unmapping (mapping budget)

    def _evict_stale(self) -> None:
        """Unmap released slots' mappings (highest slots first: lowest are handed out first) until the
        live mappings fit the budget again."""
        assert self._budget is not None
        self.mapper.wait()
        for slot in reversed(range(self.slots.num_slots)):
            if self.num_live_mappings <= self._budget:
                return
            if self.slots.is_free(slot):
                self.unmap_slot(slot)
        if self.num_live_mappings > self._budget:
            raise MemoryError(
                "xTensor: the running sequences need more memory mappings than vm.max_map_count allows; "
                "raise cache.block_size or vm.max_map_count"
            )

    def unmap_slot(self, slot: int) -> None:
        """Drop every mapping of a slot (it reads zeros again)."""
        mapped = self.slots.mapped[slot]
        held = [j for j, b in enumerate(mapped) if b != UNMAPPED]
        if not held:
            return
        for stream in range(self.num_streams):
            vrange, offset = self._stream_offset(slot, stream, 0)
            self.vmm.unmap(vrange, offset, self.slot_bytes)
        for j in held:
            self.num_mappings[mapped[j]] -= 1
            mapped[j] = UNMAPPED
        self.num_live_mappings -= len(held)
        self.num_unmaps += len(held)
        self.slots.synced[slot] = 0

    # ------------------------------------------------------------------ state

    def page_state(self, block: int, ref_cnt: int) -> PageState:
        return page_state(ref_cnt, self.num_mappings[block])

    def stats(self, ref_cnt: list[int]) -> XTensorStats:
        counts = dict.fromkeys(PageState, 0)
        for block, refs in enumerate(ref_cnt):
            counts[page_state(refs, self.num_mappings[block])] += 1
        return XTensorStats(
            num_pages=self.num_blocks,
            num_free=counts[PageState.FREE],
            num_allocated=counts[PageState.ALLOCATED],
            num_mapped=counts[PageState.MAPPED],
            num_reusable=counts[PageState.REUSABLE],
            num_maps=self.num_maps,
            num_unmaps=self.num_unmaps,
            num_live_mappings=self.num_live_mappings,
            num_slots=self.slots.num_slots,
            map_seconds=self.mapper.seconds,
        )

    def close(self) -> None:
        self.mapper.close()
        flat = getattr(self, "_flat", None)
        for vrange in [*self._chunks, *([flat] if flat is not None else [])]:
            self.vmm.release(vrange)
        self._chunks.clear()
        self._flat = None
        pages = getattr(self, "pages", None)
        if pages is not None:
            self.vmm.free_pages(pages)
            self.pages = None
