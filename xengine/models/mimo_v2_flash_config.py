"""Torch-free parsed config of MiMo-V2-Flash (``MiMoV2FlashForCausalLM``, HF ``mimo_v2_flash``).

Read as transformers' ``MiMoV2FlashConfig`` reads ``config.json``, with its defaults where a key is
absent: ``layer_types`` (layer 0 and every sixth from 5 full attention), ``mlp_layer_types`` (one dense
layer, then sparse), per-kind ``rope_parameters`` (default RoPE over ``partial_rotary_factor`` of the
head, 0.334 when not given), ``sliding_window_size`` (SGLang's, without the query) read as
``sliding_window - 1``. The sliding-window layers have twice ``num_key_value_heads`` (HF's rule).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from xengine.models.decoder_config import decoder_config_from_hf
from xengine.models.moe_config import MoeDecoderConfig, moe_config_from_hf

SWA_KV_HEAD_FACTOR = 2  # KV heads of a sliding-window layer per full-attention layer's (HF's rule)
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.334  # HF's default rope: when rope_parameters gives none
KINDS = ("full_attention", "sliding_attention")
# transformers' MiMoV2FlashConfig defaults, for keys config.json leaves out
_HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 152576,
    "hidden_size": 4096,
    "intermediate_size": 16384,
    "num_hidden_layers": 48,
    "num_attention_heads": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "moe_intermediate_size": 2048,
    "num_experts_per_tok": 8,
    "n_routed_experts": 256,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "v_head_dim": 128,
    "sliding_window": 129,
    "attention_value_scale": 0.707,
}
_DEFAULT_THETA = {"full_attention": 5_000_000.0, "sliding_attention": 10_000.0}


@dataclass(frozen=True)
class MiMoV2FlashConfig(MoeDecoderConfig):
    """``num_kv_heads`` / ``rope_theta`` / ``rotary_dim``: the full-attention layers'; ``window_*``:
    the sliding-window layers'. ``head_dim`` is the query/key head dim, ``v_head_dim`` the value's."""

    v_head_dim: int = 0
    window_num_kv_heads: int = 0
    window_rope_theta: float = 10_000.0
    window_rotary_dim: int = 0
    attention_value_scale: float = 1.0  # values are multiplied by it before attention
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0


def _require(hf: dict[str, Any], *keys: str) -> None:
    """Keys whose HF default would disagree with ``ModelInfo`` (which sizes the KV cache)."""
    missing = [k for k in keys if hf.get(k) is None]
    if missing:
        raise ValueError(f"MiMo-V2-Flash config.json must give {', '.join(missing)}")


def _per_layer(hf: dict[str, Any], key: str, default: list[str], allowed: tuple[str, ...]) -> list[str]:
    values = list(hf.get(key) or default)
    if len(values) != len(default) or set(values) - set(allowed):
        raise ValueError(f"{key} must give one of {'/'.join(allowed)} per layer, got {values}")
    return values


def _rope_of(hf: dict[str, Any], kind: str, head_dim: int) -> tuple[float, int]:
    """``(theta, rotary_dim)`` of one layer kind from the per-kind ``rope_parameters``."""
    params = hf.get("rope_parameters") or {k: {"rope_type": "default"} for k in KINDS}
    sub = params.get(kind)
    if not isinstance(sub, dict):
        raise ValueError(f"rope_parameters must hold one dict per layer type ({', '.join(KINDS)})")
    kind_of_rope = sub.get("rope_type", sub.get("type")) or "default"
    if kind_of_rope != "default":
        raise ValueError(f"rope_type {kind_of_rope!r} is not supported for MiMo-V2-Flash; only 'default'")
    theta = float(sub.get("rope_theta") or _DEFAULT_THETA[kind])
    partial = float(sub.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR))
    return theta, int(head_dim * partial)


def mimo_v2_flash_config_from_hf(hf: dict[str, Any]) -> MiMoV2FlashConfig:
    """Parse a ``mimo_v2_flash`` config; ``ValueError`` naming what this engine does not run."""
    _require(hf, "head_dim", "num_key_value_heads")
    hf = {**_HF_DEFAULTS, **{k: v for k, v in hf.items() if k in ("attention_value_scale",) or v is not None}}
    n = int(hf["num_hidden_layers"])
    default_types = [
        "full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)
    ]
    types = _per_layer(hf, "layer_types", default_types, KINDS)
    mlp_types = _per_layer(hf, "mlp_layer_types", ["dense"] + ["sparse"] * (n - 1), ("dense", "sparse"))
    window = int(hf["sliding_window"])
    if hf.get("sliding_window_size") is not None:  # attends to that many earlier tokens plus the query
        window = int(hf["sliding_window_size"]) + 1
    head_dim = int(hf["head_dim"])
    theta, rotary_dim = _rope_of(hf, "full_attention", head_dim)
    window_theta, window_rotary_dim = _rope_of(hf, "sliding_attention", head_dim)
    plain = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling", "layer_types")}
    base = decoder_config_from_hf({**plain, "rope_theta": theta}, o_bias=False)
    base = dataclasses.replace(
        base,
        rotary_dim=rotary_dim,
        sliding_windows=tuple(window if t == "sliding_attention" else None for t in types),
    )
    moe = moe_config_from_hf(base, {**hf, "num_experts": hf["n_routed_experts"]})
    value_scale = hf.get("attention_value_scale")
    return MiMoV2FlashConfig(
        **dataclasses.asdict(dataclasses.replace(moe, sparse_layers=tuple(t == "sparse" for t in mlp_types))),
        v_head_dim=int(hf["v_head_dim"]),
        window_num_kv_heads=SWA_KV_HEAD_FACTOR * base.num_kv_heads,
        window_rope_theta=window_theta,
        window_rotary_dim=window_rotary_dim,
        attention_value_scale=1.0 if value_scale is None else float(value_scale),
        n_group=int(hf["n_group"]),
        topk_group=int(hf["topk_group"]),
        routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
    )
