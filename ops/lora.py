"""Batched LoRA: one step's tokens, several adapters, one pair of matmuls per adapter (the SGMV idea).

``y += (x @ A_s^T) @ B_s^T`` for the rows of adapter slot ``s`` only. A step's rows are grouped by
slot once per step (``LoRAGroups``, built by ``xengine/lora/batch.py``): a slot whose rows are one
contiguous range (a single request, or neighbours of one adapter) is sliced, otherwise its rows are
gathered and scattered back (``index_add_``). Base-model rows are in no group and are left as they
are. ``a``: ``[num_slots, rank, in]``, ``b``: ``[num_slots, out, rank]`` with the adapter's scaling
already folded into ``b`` (``xengine/lora/slots.py``). This torch code is the reference every backend
runs today; a fused kernel (punica's SGMV / BGMV, an NPU grouped matmul) would replace
``add_lora_delta`` behind the same arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoRAGroup:
    slot: int
    start: int  # contiguous rows ``[start, end)``; ``rows`` is None then
    end: int
    rows: torch.Tensor | None = None  # the rows' indices where they are not contiguous


@dataclass
class LoRAGroups:
    groups: list[LoRAGroup] = field(default_factory=list)

    @classmethod
    def from_row_slots(cls, row_slots: list[int], device: torch.device) -> LoRAGroups:
        """Groups of a step whose row ``i`` belongs to slot ``row_slots[i]`` (-1: the base model)."""
        by_slot: dict[int, list[int]] = {}
        for i, s in enumerate(row_slots):
            if s >= 0:
                by_slot.setdefault(s, []).append(i)
        out = cls()
        for slot, rows in by_slot.items():
            if rows[-1] - rows[0] + 1 == len(rows):
                out.groups.append(LoRAGroup(slot, rows[0], rows[-1] + 1))
            else:
                index = torch.tensor(rows, dtype=torch.long, device=device)
                out.groups.append(LoRAGroup(slot, rows[0], rows[-1] + 1, index))
        return out


def add_lora_delta(
    x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, groups: LoRAGroups
) -> torch.Tensor:
    """``y`` plus every group's low-rank update (in place on ``y``; returns it)."""
    for g in groups.groups:
        a_s, b_s = a[g.slot], b[g.slot]
        if g.rows is None:
            xs = x[g.start : g.end]
            y[g.start : g.end] += (xs @ a_s.t()) @ b_s.t()
        else:
            xs = x.index_select(0, g.rows)
            y.index_add_(0, g.rows, (xs @ a_s.t()) @ b_s.t())
    return y
