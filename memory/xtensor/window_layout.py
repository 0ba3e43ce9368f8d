"""xTensor for the sliding-window KV pool (``memory/sliding_window.py``).

A sequence's window table holds ``NULL_BLOCK`` at the positions released behind its window. In this
layout those positions keep whatever their slot maps (a page of a block released earlier, or nothing:
the zero page): attention never reads them unmasked, so remapping each one to the null block as the
window slides would only spend mappings. Everything else is ``XTensorKVLayout``.
"""

from __future__ import annotations

from memory.sliding_window import NULL_BLOCK
from memory.xtensor.layout import XTensorKVLayout
from memory.xtensor.mapper import MapCall


class WindowXTensorKVLayout(XTensorKVLayout):
    def _sync(
        self, slot: int, table: list[int], needed: int, now: list[MapCall], ahead: list[MapCall]
    ) -> None:
        mapped = self.slots.mapped[slot]
        kept = [mapped[j] if b == NULL_BLOCK and j < len(mapped) else b for j, b in enumerate(table)]
        super()._sync(slot, kept, needed, now, ahead)
