"""Torch-free parsed config of a dense decoder-only model (Llama / Qwen2 / Qwen3 / Mistral family)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from xengine.models.info import hf_head_dim


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # variant parameters; None = plain RoPE
    rotary_dim: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    rope_is_neox: bool = True  # rotate halves; False: interleaved pairs (DeepSeek's rope_interleave)


def parse_rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """``(rope_theta, scaling or None, partial_rotary_factor)`` from either the transformers-5
    ``rope_parameters`` dict or the older top-level ``rope_theta`` + ``rope_scaling``."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope_parameters are not supported for this architecture")
    theta = float(params.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0)
    partial = float(params.pop("partial_rotary_factor", None) or hf.get("partial_rotary_factor") or 1.0)
    kind = params.get("rope_type", params.get("type")) or "default"
    if kind == "default":
        return theta, None, partial
    if kind in ("llama3", "yarn") and not params.get("original_max_position_embeddings"):
        params["original_max_position_embeddings"] = hf.get("max_position_embeddings")
    return theta, params, partial


def parse_sliding_windows(hf: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Per-layer window: ``sliding_window`` (when ``use_sliding_window`` is not false) on the layers
    that ``layer_types`` marks sliding, else from ``max_window_layers`` on (Qwen), else every layer."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    if not window:
        return (None,) * num_layers
    layer_types = hf.get("layer_types")
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if "max_window_layers" in hf:
        return tuple(window if i >= hf["max_window_layers"] else None for i in range(num_layers))
    return (window,) * num_layers


def decoder_config_from_hf(
    hf: dict[str, Any], *, qkv_bias: bool | None = None, o_bias: bool | None = None, qk_norm: bool = False
) -> DecoderConfig:
    """Parse a HF config dict. ``qkv_bias`` / ``o_bias`` override the config's ``attention_bias``."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU) models are supported")
    head_dim = hf_head_dim(hf)
    theta, scaling, partial = parse_rope(hf)
    attention_bias = bool(hf.get("attention_bias", False))
    num_layers = int(hf["num_hidden_layers"])
    return DecoderConfig(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=num_layers,
        num_heads=int(hf["num_attention_heads"]),
        num_kv_heads=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
        head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_dim=int(head_dim * partial),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
        o_bias=attention_bias if o_bias is None else o_bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=qk_norm,
        sliding_windows=parse_sliding_windows(hf, num_layers),
    )
