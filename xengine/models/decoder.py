"""Generic dense decoder-only transformer (pre-norm, GQA, RoPE, SwiGLU) shared by Llama, Mistral,
Qwen2 and Qwen3; the differences are flags in ``DecoderConfig``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from graph.attention_op import unified_attention
from graph.forward_context import forward_context
from ops.activation import silu_and_mul
from ops.attention import AttentionMetadata
from ops.rope_scaling import max_context_len
from xengine.layers.linear import make_weights_input_major
from xengine.layers.norm import RMSNorm
from xengine.layers.parallel_linear import column_linear, lm_head, row_linear, vocab_embedding
from xengine.layers.rotary import RotaryEmbedding
from xengine.models.base import BaseCausalLM
from xengine.models.decoder_config import DecoderConfig, decoder_config_from_hf
from xengine.models.weights import WeightLoader
from xengine.parallel.tensor import kv_head_range, split_evenly, tp_rank_size


class DecoderAttention(nn.Module):
    def __init__(
        self, cfg: DecoderConfig, rotary: RotaryEmbedding, sliding_window: int | None, layer_idx: int
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # its KV cache in the forward context
        # tensor parallel: this rank's query heads and KV heads (``xengine/parallel/tensor.py``)
        rank, size = tp_rank_size()
        self.num_heads = split_evenly(cfg.num_heads, size, "number of attention heads")
        first_kv, self.num_kv_heads = kv_head_range(cfg.num_kv_heads, rank, size)
        self.head_dim = d = cfg.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        self.qkv_proj = column_linear(
            cfg.hidden_size,
            [q_size, kv_size, kv_size],
            cfg.qkv_bias,
            [rank * q_size, first_kv * d, first_kv * d],
        )
        self.o_proj = row_linear(cfg.num_heads * d, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.sliding_window = sliding_window
        self.scale = cfg.head_dim**-0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = unified_attention(q, k, v, self.layer_idx, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class DecoderMLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        rank, size = tp_rank_size()
        local = split_evenly(cfg.intermediate_size, size, "intermediate size")
        self.gate_up_proj = column_linear(cfg.hidden_size, [local, local], cfg.mlp_bias, [rank * local] * 2)
        self.down_proj = row_linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: DecoderConfig,
        rotary: RotaryEmbedding,
        layer_idx: int,
        mlp: nn.Module | None = None,
        attn: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if attn is None:  # another attention (e.g. MLA) only where the model gives one
            attn = DecoderAttention(cfg, rotary, cfg.sliding_windows[layer_idx], layer_idx)
        self.self_attn = attn
        self.mlp = DecoderMLP(cfg) if mlp is None else mlp  # a sparse MoE block in MoE models
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(mlp output, residual stream)``; their sum is the layer's output."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(
        self,
        cfg: DecoderConfig,
        make_mlp: Callable[[int], nn.Module | None] | None = None,
        make_attention: Callable[[int, RotaryEmbedding], nn.Module | None] | None = None,
    ) -> None:
        """``make_mlp(layer_idx)`` / ``make_attention(layer_idx, rotary)``: that layer's feed-forward /
        attention module, ``None`` for the dense MLP / ``DecoderAttention``."""
        super().__init__()
        self.rotary = RotaryEmbedding(
            cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, cfg.rope_is_neox
        )
        self.embed_tokens = vocab_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(
                cfg,
                self.rotary,
                i,
                make_mlp(i) if make_mlp else None,
                make_attention(i, self.rotary) if make_attention else None,
            )
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # EAGLE-3 drafts read the residual stream entering these layers (``aux_hidden``: side by side,
        # in layer order, after a forward over the whole stack; None otherwise)
        self.aux_layers: frozenset[int] = frozenset()
        self.aux_hidden: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states of the tokens; attention reads its metadata and caches from the forward context."""
        return self.forward_layers(positions, self.embed_tokens(input_ids), None)

    def forward_layers(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, start: int = 0
    ) -> torch.Tensor:
        """Layers ``start..`` and the final norm over ``hidden`` / ``residual`` (the outputs of layer
        ``start - 1``; the embeddings and None for the whole stack)."""
        if self.aux_layers:
            return self._forward_capturing(positions, hidden, residual, start)
        for layer in self.layers[start:]:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def _forward_capturing(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, start: int
    ) -> torch.Tensor:
        captured = []
        for i in range(start, len(self.layers)):
            if i in self.aux_layers:
                captured.append(hidden if residual is None else hidden + residual)
            hidden, residual = self.layers[i](positions, hidden, residual)
        whole = len(captured) == len(self.aux_layers)
        self.aux_hidden = torch.cat(captured, dim=-1) if whole else None
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(BaseCausalLM):
    """Dense decoder LM; subclasses only choose how ``config.json`` maps onto ``DecoderConfig``."""

    tensor_parallel = True  # its layers split over a tensor-parallel group (subclasses with own layers: no)

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = self.make_model(cfg)
        self.lm_head = lm_head(cfg.hidden_size, cfg.vocab_size)
        self.tie_weights()

    def make_model(self, cfg: DecoderConfig) -> nn.Module:
        """The layer stack (``forward(input_ids, positions)``); models with their own layers override it."""
        return DecoderModel(cfg, self.make_mlp, self.make_attention)

    @classmethod
    def config_from_hf(cls, hf_config: dict[str, Any]) -> DecoderConfig:
        return decoder_config_from_hf(hf_config)

    def make_mlp(self, layer_idx: int) -> nn.Module | None:
        """The feed-forward module of layer ``layer_idx``; ``None``: the dense SwiGLU MLP."""
        return None

    def make_attention(self, layer_idx: int, rotary: RotaryEmbedding) -> nn.Module | None:
        """The attention module of layer ``layer_idx`` (``forward(positions, x)``); ``None``: GQA."""
        return None

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> DecoderForCausalLM:
        return cls(cls.config_from_hf(hf_config))

    @classmethod
    def max_context_len(cls, hf_config: dict[str, Any]) -> int | None:
        cfg = cls.config_from_hf(hf_config)
        return max_context_len(cfg.max_position_embeddings, cfg.rope_scaling)

    def set_max_model_len(self, max_model_len: int) -> None:
        self.model.rotary.set_max_len(max_model_len)

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """One forward over ``meta``'s batch with per-layer ``kv_caches`` (sets the forward context)."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"expected {len(self.model.layers)} KV caches, got {len(kv_caches)}")
        with forward_context(meta, kv_caches, input_ids.shape[0]):
            return self.forward_tokens(input_ids, positions)

    def forward_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The token work of a forward whose attention context is already set (what graphs capture)."""
        return self.model(input_ids, positions)

    def forward_embeds(
        self, input_ids: torch.Tensor, positions: torch.Tensor, embeds: torch.Tensor, at: torch.Tensor
    ) -> torch.Tensor:
        """Hidden states of a step whose rows ``at`` take ``embeds`` (prompt embeddings, vLLM's
        ``prompt_embeds``) instead of their token embeddings; the forward context must be set."""
        hidden = self.model.embed_tokens(input_ids).index_copy(
            0, at, embeds.to(self.model.embed_tokens.weight.dtype)
        )
        return self.model.forward_layers(positions, hidden, None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.tie_weights()  # re-tie: moving a meta-built model to a device may untie parameters
        make_weights_input_major(self, keep=(self.model.embed_tokens.weight,))
        skip = ("lm_head.weight",) if self.config.tie_word_embeddings else ()
        WeightLoader(self, skip=skip).load(weights)
