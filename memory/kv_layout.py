"""KV layouts: how KV tensors are laid out in memory, behind one interface.

The scheduler and the KV cache manager deal in block ids only. A layout turns them into
tensors the attention kernels read. ``PagedKVLayout`` is one tensor of pages per layer;
``memory/xtensor`` (virtually contiguous per sequence, physical pages mapped on demand) keeps the
same paged tensors for every block-level operation and adds per-sequence contiguous views.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


class BaseKVLayout(ABC):
    @abstractmethod
    def allocate(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
        """Per-layer KV tensors for ``num_blocks`` blocks."""

    @abstractmethod
    def copy_blocks(self, kv_caches: list[torch.Tensor], copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` in every layer (copy-on-write forks)."""

    def attention_caches(self, kv_caches: list[torch.Tensor]) -> list[Any]:
        """What the model's attention layers get, one per layer (the paged tensors themselves here)."""
        return kv_caches

    def prepare(self, seqs: list[tuple[str, list[int], int]]) -> list[int] | None:
        """Before a step: make ``(seq_id, block table, tokens covered)`` readable; returns per-sequence
        slots for attention (None: the layout reads through block tables)."""
        return None

    def close(self) -> None:  # noqa: B027 - most layouts hold nothing to release
        """Release the layout's memory (the tensors it returned are invalid afterwards)."""


class PagedKVLayout(BaseKVLayout):
    """Layer ``i``: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (0 = K, 1 = V)."""

    def allocate(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
        shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        # zeros, not empty: masked-out padding positions must hold finite values
        return [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]

    def copy_blocks(self, kv_caches: list[torch.Tensor], copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], device=kv_caches[0].device)
        dst = torch.tensor([c[1] for c in copies], device=kv_caches[0].device)
        for cache in kv_caches:
            cache[:, dst] = cache[:, src]
