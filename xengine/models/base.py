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

    @classmethod
    def max_context_len(cls, hf_config: dict[str, Any]) -> int | None:
        """Longest sequence (prompt + output) the model's position encoding supports, read from a HF
        ``config.json`` dict without building the model; ``None``: any length."""
        return int(hf_config.get("max_position_embeddings", 2048))

    def set_max_model_len(self, max_model_len: int) -> None:
        """Size position tables for sequences of up to ``max_model_len`` tokens (at most
        ``max_context_len``); models without such tables need nothing."""

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
    def forward_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The token work of ``forward`` once the forward context (``graph/forward_context.py``: metadata
        and caches for attention) is set; what graph runners compile. Returns [T, hidden]."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 logits."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the model; ``ValueError`` on unknown or missing ones."""
