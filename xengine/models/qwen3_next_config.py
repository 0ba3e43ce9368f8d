"""Torch-free parsed config of Qwen3-Next (``Qwen3NextForCausalLM``): the MoE decoder's fields plus the
layer types (gated DeltaNet or gated full attention), the DeltaNet's shapes and the shared expert."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from xengine.models.decoder_config import decoder_config_from_hf
from xengine.models.moe_config import MoeDecoderConfig, moe_config_from_hf

LINEAR, FULL = "linear_attention", "full_attention"
# HF ``Qwen3NextConfig`` defaults that differ from the generic decoder's, for keys a config.json may omit
_HF_DEFAULTS = {"head_dim": 256, "num_key_value_heads": 2, "max_position_embeddings": 32768,
                "partial_rotary_factor": 0.25, "num_experts": 512, "num_experts_per_tok": 10,
                "moe_intermediate_size": 512, "norm_topk_prob": True}  # fmt: skip


@dataclass(frozen=True)
class Qwen3NextConfig(MoeDecoderConfig):
    # defaults only so that the dataclass may extend its parent; ``qwen3_next_config_from_hf`` sets each
    layer_types: tuple[str, ...] = ()  # per layer: "linear_attention" (gated DeltaNet) or "full_attention"
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0  # a multiple of the key heads (each key head serves a group)
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    shared_expert_intermediate_size: int = 0

    @property
    def linear_layers(self) -> list[int]:
        """Indices of the gated-DeltaNet (recurrent) layers."""
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]


def _layer_types(hf: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """``layer_types``, else every ``full_attention_interval``-th layer full attention (HF's default 4)."""
    types = hf.get("layer_types")
    if not types:
        interval = int(hf.get("full_attention_interval") or 4)
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {LINEAR, FULL}:
        raise ValueError(
            f"layer_types must give one of {LINEAR}/{FULL} per layer ({num_layers}), got {types}"
        )
    return tuple(types)


def _positive(hf: dict[str, Any], key: str, default: int | None = None) -> int:
    value = hf.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")
    return value


def qwen3_next_config_from_hf(hf: dict[str, Any]) -> Qwen3NextConfig:
    """Parse a ``qwen3_next`` config dict; ``ValueError`` naming the key this engine does not run."""
    hf = {**hf, **{k: v for k, v in _HF_DEFAULTS.items() if hf.get(k) is None}}
    # HF's Qwen3-Next reads neither (full attention everywhere, bias-free MLPs): neither do we
    base = decoder_config_from_hf({**hf, "sliding_window": None, "mlp_bias": False}, qk_norm=True)
    if base.rotary_dim % 2 or base.rotary_dim == 0:
        raise ValueError(f"partial_rotary_factor gives an odd or empty rotary dimension ({base.rotary_dim})")
    num_layers = base.num_layers
    layer_types = _layer_types(hf, num_layers)
    key_heads = _positive(hf, "linear_num_key_heads", 16)
    value_heads = _positive(hf, "linear_num_value_heads", 32)
    if value_heads % key_heads:
        raise ValueError(
            f"linear_num_value_heads ({value_heads}) must be a multiple of linear_num_key_heads ({key_heads})"
        )
    moe = moe_config_from_hf(base, hf)
    return Qwen3NextConfig(
        **{f.name: getattr(moe, f.name) for f in dataclasses.fields(MoeDecoderConfig)},
        layer_types=layer_types,
        linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=_positive(hf, "linear_key_head_dim", 128),
        linear_value_head_dim=_positive(hf, "linear_value_head_dim", 128),
        linear_conv_kernel_dim=_positive(hf, "linear_conv_kernel_dim", 4),
        shared_expert_intermediate_size=_positive(hf, "shared_expert_intermediate_size", 512)
        if moe.num_experts
        else 0,
    )
