"""Torch-free parsed config of Nemotron-H (``NemotronHForCausalLM``): which block each layer is and
the shapes of its Mamba2 mixers, attention, squared-ReLU MLPs and MoE blocks.

The layer kinds come from ``layers_block_type`` / ``layer_types`` (transformers 5) or the older
``hybrid_override_pattern`` string (``M`` Mamba2, ``*`` attention, ``-`` MLP, ``E`` MoE); the older
``mamba_*`` key names (``mamba_n_groups``, ``mamba_d_conv``, ...) are read as transformers reads them,
and NVIDIA's ``attention_head_dim`` where ``head_dim`` is missing.
What this engine does not run is refused with a ``ValueError`` naming the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
_PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}
# older key -> transformers 5 key
_LEGACY_KEYS = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
    "mamba_dt_limit": "time_step_limit",
}


@dataclass(frozen=True)
class NemotronHConfig:
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # per layer: MAMBA, ATTENTION, MLP or MOE
    norm_eps: float  # every RMSNorm's (``layer_norm_epsilon``)
    max_position_embeddings: int
    # attention (no RoPE: position comes from the Mamba2 layers)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # squared-ReLU MLP
    intermediate_size: int
    mlp_bias: bool
    # Mamba2 mixer
    mamba_num_heads: int
    mamba_head_dim: int
    n_groups: int  # of B / C and of the gated output norm
    ssm_state_size: int
    conv_kernel: int
    use_conv_bias: bool
    use_bias: bool  # in_proj / out_proj
    chunk_size: int  # tokens per block of the chunked SSD scan
    time_step_limit: tuple[float, float]  # dt clamped to [lo, hi] after softplus
    # MoE
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    moe_latent_size: int | None  # experts run in this width between two projections; None: hidden
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def mamba_intermediate_size(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal convolution: x, then B and C of every group."""
        return self.mamba_intermediate_size + 2 * self.n_groups * self.ssm_state_size


def _as_float(value: Any, key: str) -> float:
    """A JSON number, or transformers' ``{"__float__": "Infinity"}`` encoding of a non-finite one."""
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    try:
        return float(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{key} must hold numbers, got {value!r}") from e


def parse_layer_types(hf: dict[str, Any]) -> tuple[str, ...]:
    """Each layer's block kind, from ``layers_block_type`` / ``layer_types`` or ``hybrid_override_pattern``."""
    for key in ("layers_block_type", "layer_types"):
        types = hf.get(key)
        if types is not None:
            if not isinstance(types, list) or any(t not in _PATTERN.values() for t in types):
                raise ValueError(
                    f"{key} must list one of {sorted(_PATTERN.values())} per layer, got {types!r}"
                )
            return tuple(types)
    pattern = hf.get("hybrid_override_pattern")
    if not isinstance(pattern, str) or not pattern or any(c not in _PATTERN for c in pattern):
        raise ValueError(
            f"hybrid_override_pattern must be a string of {''.join(_PATTERN)} (one per layer), got {pattern!r}"
        )
    return tuple(_PATTERN[c] for c in pattern)


def _refuse_unsupported(hf: dict[str, Any]) -> None:
    """``ValueError`` naming the first key whose value this engine does not implement."""
    expected = {"mamba_hidden_act": "silu", "mlp_hidden_act": "relu2"}
    for key, value in expected.items():
        if hf.get(key, value) != value:
            raise ValueError(f"unsupported {key} {hf[key]!r} for Nemotron-H; expected {value!r}")
    if hf.get("sliding_window") is not None:
        raise ValueError("sliding_window is not supported for Nemotron-H (its attention layers are global)")
    if hf.get("attention_bias"):
        raise ValueError("attention_bias is not supported for Nemotron-H (its attention has no biases)")
    if hf.get("residual_in_fp32"):
        raise ValueError(
            "residual_in_fp32 is not supported: the residual stream is kept in the model's dtype "
            "(as transformers does); set it to false or run the model in float32"
        )


def _time_step_limit(hf: dict[str, Any]) -> tuple[float, float]:
    limit = hf.get("time_step_limit") or (0.0, math.inf)
    if not isinstance(limit, (list, tuple)) or len(limit) != 2:
        raise ValueError(f"time_step_limit must be [min, max], got {limit!r}")
    lo, hi = (_as_float(v, "time_step_limit") for v in limit)
    if not 0.0 <= lo <= hi:
        raise ValueError(f"time_step_limit must satisfy 0 <= min <= max, got {list(limit)}")
    return lo, hi


def nemotron_h_config_from_hf(hf: dict[str, Any]) -> NemotronHConfig:
    """Parse a ``nemotron_h`` ``config.json`` dict (a missing key takes transformers' default);
    ``ValueError`` naming what is not supported."""
    hf = {**{new: hf[old] for old, new in _LEGACY_KEYS.items() if old in hf and new not in hf}, **hf}
    _refuse_unsupported(hf)
    types = parse_layer_types(hf)
    num_heads = int(hf.get("num_attention_heads", 32))
    cfg = NemotronHConfig(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        layer_types=types,
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads", 8) or num_heads),
        head_dim=int(hf.get("head_dim") or hf.get("attention_head_dim") or 128),  # transformers' default
        intermediate_size=int(hf.get("intermediate_size", 21504)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        mamba_num_heads=int(hf.get("mamba_num_heads", 128)),
        mamba_head_dim=int(hf.get("mamba_head_dim", 64)),
        n_groups=int(hf.get("n_groups", 8)),
        ssm_state_size=int(hf.get("ssm_state_size", 128)),
        conv_kernel=int(hf.get("conv_kernel", 4)),
        use_conv_bias=bool(hf.get("use_conv_bias", True)),
        use_bias=bool(hf.get("use_bias", False)),
        chunk_size=int(hf.get("chunk_size", 128)),
        time_step_limit=_time_step_limit(hf),
        num_experts=int(hf.get("n_routed_experts", 8)),
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 2)),
        moe_intermediate_size=int(hf.get("moe_intermediate_size", 7688)),
        shared_expert_intermediate_size=int(hf.get("moe_shared_expert_intermediate_size", 7688)),
        moe_latent_size=int(hf["moe_latent_size"]) if hf.get("moe_latent_size") else None,
        n_group=int(hf.get("n_group", 1) or 1),
        topk_group=int(hf.get("topk_group", 1) or 1),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
    )
    _check_shapes(cfg)
    return cfg


def _check_shapes(cfg: NemotronHConfig) -> None:
    if cfg.mamba_num_heads % cfg.n_groups:
        raise ValueError(f"n_groups ({cfg.n_groups}) must divide mamba_num_heads ({cfg.mamba_num_heads})")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(
            f"num_key_value_heads ({cfg.num_kv_heads}) must divide num_attention_heads ({cfg.num_heads})"
        )
    if cfg.chunk_size < 1 or cfg.conv_kernel < 2:
        raise ValueError(
            f"chunk_size must be >= 1 and conv_kernel >= 2, got {cfg.chunk_size}, {cfg.conv_kernel}"
        )
    if MOE in cfg.layer_types and not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
        raise ValueError(
            f"num_experts_per_tok must be in [1, n_routed_experts={cfg.num_experts}], got {cfg.num_experts_per_tok}"
        )
