"""Rotary embedding with a float32 cos/sin cache built lazily per device and shared by all layers."""

from __future__ import annotations

from typing import Any

import torch

from ops.rope import build_cos_sin_cache, rotary_embedding
from ops.rope_scaling import max_context_len


class RotaryEmbedding:
    """Plain object (not an ``nn.Module``) so dtype casts of the model never touch the float32 cache."""

    def __init__(
        self,
        rotary_dim: int,
        max_position: int,
        base: float,
        scaling: dict[str, Any] | None = None,
        is_neox: bool = True,
    ) -> None:
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.base = base
        self.scaling = scaling
        self.is_neox = is_neox
        self.max_len: int | None = None  # the engine's max_model_len, once set
        self._cache: torch.Tensor | None = None

    def set_max_len(self, max_len: int) -> None:
        """Cover positions ``[0, max_len)``; ``ValueError`` if the scaling variant does not reach that far."""
        limit = max_context_len(self.max_position, self.scaling)
        if limit is not None and max_len > limit:
            raise ValueError(
                f"max_model_len {max_len} is past the {limit} positions this model's RoPE supports"
            )
        self.max_len = max_len
        self._cache = None

    def cos_sin_cache(self, device: torch.device) -> torch.Tensor:
        """``[num_positions, rotary_dim]`` float32 cache on ``device`` (built on first use there)."""
        if self._cache is None or self._cache.device != device:
            cache = build_cos_sin_cache(
                self.rotary_dim, self.max_position, self.base, self.scaling, max_len=self.max_len
            )
            self._cache = cache.to(device)
        return self._cache

    def __call__(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.cos_sin_cache(positions.device)
        return rotary_embedding(positions, q, k, cache, self.is_neox)
