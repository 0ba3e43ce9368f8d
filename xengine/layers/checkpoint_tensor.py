"""Checkpoint tensors a tensor-parallel rank reads only in part.

``iterate_weights(..., lazy=True)`` yields a ``LazyTensor`` per checkpoint entry: its shape, and a
slice read from the file on request (safetensors reads just those bytes), so a rank never
materialises a full tensor it holds a shard of. Layers go through ``narrow`` / ``materialize``, which
take a plain ``torch.Tensor`` as well (tests and single-process loading pass those).
"""

from __future__ import annotations

from typing import Any

import torch


class LazyTensor:
    """One checkpoint tensor, not read yet (valid while its file is open)."""

    def __init__(self, name: str, handle: Any) -> None:
        self.name = name
        self._slice = handle.get_slice(name)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * dim + [slice(start, start + length)]
        return self._slice[tuple(index)]

    def materialize(self) -> torch.Tensor:
        return self._slice[:]


def narrow(tensor: torch.Tensor | LazyTensor, dim: int, start: int, length: int) -> torch.Tensor:
    """Rows ``start .. start + length`` of ``tensor`` along ``dim`` (``ValueError`` past its end)."""
    size = tensor.shape[dim]
    if start < 0 or start + length > size:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(tensor.shape)}: rows {start}..{start + length} of dim {dim} "
            "are past its end (does it match the model's config?)"
        )
    return tensor.narrow(dim, start, length)


def materialize(tensor: torch.Tensor | LazyTensor) -> torch.Tensor:
    """The whole tensor (read from the file when lazy)."""
    return tensor.materialize() if isinstance(tensor, LazyTensor) else tensor
