"""KV layouts: how KV tensors are laid out in memory, behind one interface.

The scheduler and the KV cache manager deal in block ids only. A layout turns them into
tensors the attention kernels read. ``PagedKVLayout`` is one tensor of pages per layer;
``memory/xtensor`` (virtually contiguous per sequence, physical pages mapped on demand) keeps the
same paged tensors for every block-level operation and adds per-sequence contiguous views.

With ``kv_cache_dtype`` int8 / fp8 a layer's tensor holds 8-bit rows with their scales
(``ops/kv_quant.py``): ``[2, num_blocks, block_size, num_kv_heads, head_dim + 4]`` of ``torch.int8``
(int8) or ``torch.uint8`` (fp8 bits); everything block-level moves the bytes as they are.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ops.kv_quant import STORAGE_DTYPES, row_width


@dataclass(frozen=True)
class KVCacheSpec:
    """Geometry and element type of the KV pool. ``dtype`` is the model's (activation) dtype;
    ``kv_cache_dtype`` ("auto": ``dtype``, or "int8" / "fp8") what the cache stores."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    kv_cache_dtype: str = "auto"

    @property
    def storage_dtype(self) -> torch.dtype:
        """The cache tensors' dtype (8-bit caches: int8 / uint8, see ``ops/kv_quant.py``)."""
        return STORAGE_DTYPES.get(self.kv_cache_dtype, self.dtype)

    @property
    def row_width(self) -> int:
        """Last dimension of the cache tensors: ``head_dim`` (+ 4 scale bytes when 8-bit)."""
        return row_width(self.head_dim, self.kv_cache_dtype)

    @property
    def cache_dtype_name(self) -> str:
        """The element type blocks hold ("float32", "bfloat16", "int8", "fp8"): two instances may
        exchange blocks only when theirs agree."""
        if self.kv_cache_dtype in STORAGE_DTYPES:
            return self.kv_cache_dtype
        return str(self.dtype).replace("torch.", "")

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K (or V) in one layer, scales included."""
        elem = torch.empty((), dtype=self.storage_dtype).element_size()
        return self.num_kv_heads * self.row_width * elem

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.block_size * self.token_bytes


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

    def prepare(self, seqs: Iterable[tuple[str, list[int], int]]) -> list[int] | None:
        """Before a step: make ``(seq_id, block table, tokens covered)`` readable; returns per-sequence
        slots for attention (None: the layout reads through block tables)."""
        return None

    def close(self) -> None:  # noqa: B027 - most layouts hold nothing to release
        """Release the layout's memory (the tensors it returned are invalid afterwards)."""


class PagedKVLayout(BaseKVLayout):
    """Layer ``i``: ``[2, num_blocks, block_size, num_kv_heads, row_width]`` (0 = K, 1 = V)."""

    def allocate(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
        shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.row_width)
        # zeros, not empty: masked-out padding positions must hold finite values (8-bit: value 0, scale 0)
        return [torch.zeros(shape, dtype=spec.storage_dtype, device=device) for _ in range(spec.num_layers)]

    def copy_blocks(self, kv_caches: list[torch.Tensor], copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], device=kv_caches[0].device)
        dst = torch.tensor([c[1] for c in copies], device=kv_caches[0].device)
        for cache in kv_caches:
            cache[:, dst] = cache[:, src]
