"""Gemma 3 (text, ``Gemma3ForCausalLM``): sliding-window and full-attention layers interleaved
(``layer_types``; five local to one global in the released models), each kind with its own RoPE
(``rope_parameters`` per layer type), four RMSNorms per layer with ``(1 + weight)`` scaling, q/k norms,
GeGLU (tanh GELU), embeddings scaled by ``sqrt(hidden_size)``, attention scaled by
``query_pre_attn_scalar ** -0.5`` and an optional final logit soft-cap."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ops.activation import gelu_tanh_and_mul
from ops.rope_scaling import max_context_len
from xengine.layers.linear import make_weights_input_major
from xengine.layers.norm import RMSNorm
from xengine.layers.parallel_linear import column_linear, row_linear, vocab_embedding
from xengine.layers.rotary import RotaryEmbedding
from xengine.models.decoder import DecoderAttention, DecoderForCausalLM
from xengine.models.decoder_config import DecoderConfig, decoder_config_from_hf, parse_rope
from xengine.models.weights import WeightLoader
from xengine.parallel.tensor import split_evenly, tp_rank_size

_DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


@dataclass(frozen=True)
class Gemma3Config(DecoderConfig):
    local_rope_theta: float = 10_000.0
    local_rope_scaling: dict[str, Any] | None = None
    query_pre_attn_scalar: float = 256.0
    final_logit_softcapping: float | None = None


def _layer_types(hf: dict[str, Any], num_layers: int) -> list[str]:
    """``layer_types``, else every ``sliding_window_pattern``-th layer global (older configs)."""
    types = hf.get("layer_types")
    if types:
        return list(types)
    pattern = int(hf.get("sliding_window_pattern") or 6)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]


def _rope_of(hf: dict[str, Any], kind: str) -> tuple[float, dict[str, Any] | None]:
    """``(theta, scaling)`` of one layer type: from per-type ``rope_parameters`` (transformers 5),
    else the older top-level ``rope_theta`` / ``rope_scaling`` (global) and ``rope_local_base_freq``."""
    params = hf.get("rope_parameters") or {}
    if isinstance(params.get(kind), dict):
        sub = {"rope_parameters": params[kind], "max_position_embeddings": hf.get("max_position_embeddings")}
        if not params[kind].get("rope_theta"):
            sub["rope_theta"] = _DEFAULT_THETA[kind]
    elif kind == "full_attention":
        sub = {**hf, "rope_theta": hf.get("rope_theta") or _DEFAULT_THETA[kind]}
    else:
        sub = {"rope_theta": hf.get("rope_local_base_freq") or _DEFAULT_THETA[kind]}
    theta, scaling, partial = parse_rope(sub)
    if partial != 1.0:
        raise ValueError("partial_rotary_factor is not supported for Gemma 3")
    return theta, scaling


def gemma3_config_from_hf(hf: dict[str, Any]) -> Gemma3Config:
    """Parse a ``gemma3_text`` config; ``ValueError`` naming what this engine does not run."""
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"unsupported hidden_activation {act!r} for Gemma 3; expected 'gelu_pytorch_tanh'")
    if hf.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping is not supported (Gemma 2 style); Gemma 3 has none")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (an embedding model) is not supported for generation")
    num_layers = int(hf["num_hidden_layers"])
    types = _layer_types(hf, num_layers)
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != num_layers:
        raise ValueError(
            f"layer_types must give one of sliding_attention/full_attention per layer, got {types}"
        )
    theta, scaling = _rope_of(hf, "full_attention")
    local_theta, local_scaling = _rope_of(hf, "sliding_attention")
    plain = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling", "layer_types")}
    base = decoder_config_from_hf({**plain, "hidden_act": "silu", "rope_theta": theta}, qk_norm=True)
    window = hf.get("sliding_window")
    return Gemma3Config(
        **{f.name: getattr(base, f.name) for f in dataclasses.fields(DecoderConfig)}
        | {
            "rope_scaling": scaling,
            "sliding_windows": tuple(window if t == "sliding_attention" else None for t in types),
            "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
        },
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        final_logit_softcapping=hf.get("final_logit_softcapping"),
    )


class Gemma3MLP(nn.Module):
    def __init__(self, cfg: Gemma3Config) -> None:
        super().__init__()
        rank, size = tp_rank_size()
        local = split_evenly(cfg.intermediate_size, size, "intermediate size")
        self.gate_up_proj = column_linear(cfg.hidden_size, [local, local], False, [rank * local] * 2)
        self.down_proj = row_linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class Gemma3Layer(nn.Module):
    """Norms around both sub-layers: ``x + post_attn(attn(in(x)))``, then ``+ post_ff(mlp(pre_ff(.)))``."""

    def __init__(self, cfg: Gemma3Config, rotary: RotaryEmbedding, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(cfg, rotary, cfg.sliding_windows[layer_idx], layer_idx)
        self.self_attn.scale = cfg.query_pre_attn_scalar**-0.5
        self.mlp = Gemma3MLP(cfg)
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(normed MLP output, residual stream)``; their sum is the layer's output."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3Model(nn.Module):
    def __init__(self, cfg: Gemma3Config) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(
            cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.rotary_local = RotaryEmbedding(
            cfg.rotary_dim, cfg.max_position_embeddings, cfg.local_rope_theta, cfg.local_rope_scaling
        )
        self.embed_tokens = vocab_embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_scale = math.sqrt(cfg.hidden_size)
        self.layers = nn.ModuleList(
            Gemma3Layer(cfg, self.rotary_local if w is not None else self.rotary, i)
            for i, w in enumerate(cfg.sliding_windows)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight
        hidden = self.embed_tokens(input_ids) * torch.tensor(self.embed_scale, dtype=weight.dtype)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Gemma3ForCausalLM(DecoderForCausalLM):
    def make_model(self, cfg: Gemma3Config) -> nn.Module:  # type: ignore[override]
        return Gemma3Model(cfg)

    @classmethod
    def config_from_hf(cls, hf_config: dict[str, Any]) -> Gemma3Config:
        return gemma3_config_from_hf(hf_config)

    @classmethod
    def max_context_len(cls, hf_config: dict[str, Any]) -> int | None:
        cfg = cls.config_from_hf(hf_config)
        limits = [
            max_context_len(cfg.max_position_embeddings, s)
            for s in (cfg.rope_scaling, cfg.local_rope_scaling)
        ]
        known = [x for x in limits if x is not None]
        return min(known) if known else None

    def set_max_model_len(self, max_model_len: int) -> None:
        self.model.rotary.set_max_len(max_model_len)
        self.model.rotary_local.set_max_len(max_model_len)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.tie_weights()
        make_weights_input_major(self, keep=(self.model.embed_tokens.weight,))
        skip = ("lm_head.weight",) if self.config.tie_word_embeddings else ()
        WeightLoader(self, skip=skip).load(weights)
        with torch.no_grad():  # Gemma's norms scale by (1 + weight): folded in once here
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.weight.add_(1.0)
