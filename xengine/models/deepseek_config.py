"""Torch-free parsed config of DeepSeek-V3: MLA attention dims, grouped routing, shared experts."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from xengine.models.decoder_config import decoder_config_from_hf
from xengine.models.moe_config import MoeDecoderConfig, moe_config_from_hf


@dataclass(frozen=True)
class DeepseekV3Config(MoeDecoderConfig):
    """``num_kv_heads`` / ``head_dim`` describe the latent cache (1 head of ``kv_lora_rank +
    qk_rope_head_dim``); ``rotary_dim`` is ``qk_rope_head_dim``."""

    q_lora_rank: int | None = None  # None: a plain q_proj
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    attention_scale: float = 1.0  # qk_head_dim ** -0.5, times YaRN's mscale(mscale_all_dim) squared
    attention_bias: bool = False
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_scale(hf: dict[str, Any], qk_head_dim: int, rope_scaling: dict[str, Any] | None) -> float:
    """HF's ``yarn_apply_mscale``: a non-default RoPE with ``mscale_all_dim`` scales the softmax by its
    mscale squared."""
    scale = qk_head_dim**-0.5
    if rope_scaling and rope_scaling.get("mscale_all_dim"):
        scale *= _yarn_mscale(rope_scaling["factor"], rope_scaling["mscale_all_dim"]) ** 2
    return scale


def deepseek_v3_config_from_hf(hf: dict[str, Any]) -> DeepseekV3Config:
    rope_dim, lora = int(hf["qk_rope_head_dim"]), int(hf["kv_lora_rank"])
    base = decoder_config_from_hf(hf)
    base = dataclasses.replace(
        base,
        num_kv_heads=1,
        head_dim=lora + rope_dim,
        rotary_dim=rope_dim,
        rope_is_neox=not hf.get("rope_interleave", True),
        sliding_windows=(None,) * base.num_layers,
    )
    moe = moe_config_from_hf(base, {"num_experts": hf.get("n_routed_experts"), **hf})
    num_dense = int(hf.get("first_k_dense_replace") or 0)
    sparse = tuple(moe.num_experts > 0 and i >= num_dense for i in range(base.num_layers))
    qk_nope = int(hf["qk_nope_head_dim"])
    return DeepseekV3Config(
        **dataclasses.asdict(dataclasses.replace(moe, sparse_layers=sparse)),
        q_lora_rank=int(hf["q_lora_rank"]) if hf.get("q_lora_rank") else None,
        kv_lora_rank=lora,
        qk_nope_head_dim=qk_nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=int(hf["v_head_dim"]),
        attention_scale=attention_scale(hf, qk_nope + rope_dim, base.rope_scaling),
        attention_bias=bool(hf.get("attention_bias", False)),
        n_shared_experts=int(hf.get("n_shared_experts") or 0),
        n_group=int(hf.get("n_group") or 1),
        topk_group=int(hf.get("topk_group") or 1),
        routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
    )
