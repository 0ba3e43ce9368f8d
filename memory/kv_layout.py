"""KV layouts: how KV tensors are laid out in memory, behind one interface.

The scheduler and the KV cache manager deal in block ids only. A layout turns them into
tensors the attention kernels read. ``PagedKVLayout`` is one tensor of pages per layer; an
xTensor layout (virtually contiguous per request, physical pages mapped on demand) implements
the same interface later.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

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
