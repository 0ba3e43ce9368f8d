"""``BaseCausalLM``: the interface the runner and loader use for every model."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ops.attention import AttentionMetadata


class BaseCausalLM(nn.Module, ABC):
    """A causal LM over flattened tokens (no batch dim) with a paged KV cache per layer."""

    @classmethod
    @abstractmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> BaseCausalLM:
        """Build the (uninitialised) model from a HF ``config.json`` dict."""

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``input_ids`` / ``positions``: [T] int64; ``kv_caches[i]``: layer i's
        [2, num_blocks, block_size, num_kv_heads, head_dim] cache. Returns hidden states [T, hidden]."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 logits."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the model; ``ValueError`` on unknown or missing ones."""
