"""The recurrent layers' state tensors: per layer a tuple of ``[num_slots, *shape]`` tensors whose
slots ``memory/recurrent_state.py`` hands out (sequence slots, then snapshot slots)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateShape:
    """One state tensor of a recurrent layer: its shape per sequence and its dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


class RecurrentStatePool:
    """The state tensors: per recurrent layer a tuple of ``[num_slots, *shape]`` tensors (zeros)."""

    def __init__(
        self, shapes: dict[int, tuple[StateShape, ...]], num_slots: int, device: torch.device
    ) -> None:
        self.shapes = shapes
        self.num_slots = num_slots
        self.layers: dict[int, tuple[torch.Tensor, ...]] = {
            layer: tuple(torch.zeros((num_slots, *s.shape), dtype=s.dtype, device=device) for s in specs)
            for layer, specs in shapes.items()
        }

    @staticmethod
    def bytes_per_slot(shapes: dict[int, tuple[StateShape, ...]]) -> int:
        return sum(s.nbytes for specs in shapes.values() for s in specs)

    def per_layer(self, num_layers: int) -> list[tuple[torch.Tensor, ...] | None]:
        """What the forward context carries: layer i's tensors, None for a layer without state."""
        return [self.layers.get(i) for i in range(num_layers)]

    def copy(self, copies: list[tuple[int, int]]) -> None:
        """Slot copies ``(src, dst)`` in every layer (a prefix hit's snapshot, a fork's parent)."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies])
        dst = torch.tensor([d for _, d in copies])
        for tensors in self.layers.values():
            for t in tensors:
                t.index_copy_(0, dst.to(t.device), t.index_select(0, src.to(t.device)))
