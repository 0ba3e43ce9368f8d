"""Page states of the xTensor pool, as the xLLM report defines them, and the pool's counters.

A *page* is the memory of one KV block (``block_size`` tokens) in every layer's K and V; page ``b`` is
block ``b`` of the block pool, which owns it by reference count. Its state follows from who owns it
and where it is mapped:

- ``FREE``: no sequence holds it and no slot maps it;
- ``ALLOCATED``: held (by a sequence, a prefix-cache import pin, a pre-mapping look-ahead) but not
  mapped into any slot yet;
- ``MAPPED``: held and mapped into a slot;
- ``REUSABLE``: nobody holds it, but a slot still maps it (a finished sequence's slot keeps its
  mappings so the next sequence there maps nothing where blocks match).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class PageState(enum.Enum):
    FREE = "free"
    ALLOCATED = "allocated"
    MAPPED = "mapped"
    REUSABLE = "reusable"


def page_state(ref_cnt: int, num_mappings: int) -> PageState:
    if ref_cnt > 0:
        return PageState.MAPPED if num_mappings else PageState.ALLOCATED
    return PageState.REUSABLE if num_mappings else PageState.FREE


@dataclass
class XTensorStats:
    num_pages: int
    num_free: int
    num_allocated: int
    num_mapped: int
    num_reusable: int
    num_maps: int  # page mappings made since start (one page = every layer's K and V of one block)
    num_unmaps: int
    num_live_mappings: int  # (slot, position) -> page mappings in place now
    num_slots: int
    map_seconds: float  # time spent in map/unmap calls
