"""Tiny / small MiMo-V2-Flash checkpoints for ``make_tiny`` (``xllm model make-tiny --arch mimo_v2_flash``).

The released model's shape in miniature: full-attention layers (layer 0 and every ``every``-th after it)
among sliding-window ones with twice the KV heads and learned attention sinks, a query/key head dim
larger than the value head dim (3:2, as 192:128), partial RoPE (a third of the head) with its own theta
per layer kind, a dense first layer and sparse MoE layers after it (sigmoid router, grouped top-k, no
shared experts). Windows are shorter than the prompts the tests send.
"""

from __future__ import annotations

from typing import Any

# window: sliding_window; every: a full-attention layer at each multiple of it (layer 0 included), so
# tiny is 1 full : 4 sliding and small 1 : 5; kv: the full layers' KV heads (the sliding ones have twice)
_SHAPE: dict[str, dict[str, Any]] = {
    "tiny": dict(layers=5, every=5, window=32, heads=4, kv=1, head_dim=48, v_head_dim=32),
    "small": dict(layers=12, every=6, window=128, heads=8, kv=2, head_dim=96, v_head_dim=64),
}
_MOE: dict[str, dict[str, Any]] = {
    "tiny": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
    "small": dict(n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=40),
}
_MOE_COMMON = dict(n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=1.5)
_ROPE = {"full_attention": 5_000_000.0, "sliding_attention": 10_000.0}
PARTIAL_ROTARY_FACTOR = 0.334  # the released checkpoint's: 64 of 192 dims rotate
ATTENTION_VALUE_SCALE = 0.707


def tiny_config(size: str, kw: dict[str, Any]) -> Any:
    """The ``MiMoV2FlashConfig`` of ``size`` ("tiny" ~1.5M parameters, "small" ~55M) over ``kw`` (the
    common keys of ``make_tiny``: vocabulary, hidden size, eos, ...)."""
    from transformers import MiMoV2FlashConfig

    shape = _SHAPE[size]
    kw = dict(kw)
    kw.update(
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv"],
        head_dim=shape["head_dim"],
    )
    n = shape["layers"]
    types = ["full_attention" if i % shape["every"] == 0 else "sliding_attention" for i in range(n)]
    rope = {
        kind: {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": PARTIAL_ROTARY_FACTOR}
        for kind, theta in _ROPE.items()
    }
    return MiMoV2FlashConfig(
        **kw,
        **_MOE[size],
        **_MOE_COMMON,
        v_head_dim=shape["v_head_dim"],
        sliding_window=shape["window"],
        layer_types=types,
        mlp_layer_types=["dense"] + ["sparse"] * (n - 1),
        rope_parameters=rope,
        attention_value_scale=ATTENTION_VALUE_SCALE,
    )


def randomise(model: Any, seed: int) -> None:
    """RMSNorm weights (HF: ones) become ``1 + 0.3 N(0, 1)``. Attention sinks (HF: ~0, which this
    initialisation's scores, of standard deviation ``sigma = initializer_range ** 2 * hidden_size``,
    would drown) become ``sigma * (2 + 0.4 N(0, 1))``: near the top score of a window, so a sink takes
    a real share of the attention without swallowing it. Router biases are ``make_tiny``'s."""
    import torch

    config = model.config
    sigma = config.initializer_range**2 * config.hidden_size
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=gen))
            elif name.endswith("self_attn.sinks"):
                param.copy_(sigma * (2.0 + 0.4 * torch.randn(param.shape, generator=gen)))
