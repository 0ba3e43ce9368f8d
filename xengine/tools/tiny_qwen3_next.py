"""Tiny / small Qwen3-Next checkpoints for ``xllm model make-tiny --arch qwen3_next``.

Three gated-DeltaNet layers to one gated full-attention layer (``full_attention_interval`` 4, as the
released models), GQA inside the DeltaNet (twice as many value heads as key heads), partial RoPE (a
quarter of the head), and MoE feed-forward blocks of a few small experts plus the gated shared expert;
tiny makes its first layer a dense MLP (``mlp_only_layers``) so both feed-forward kinds are exercised.
"""

from __future__ import annotations

from typing import Any

# per size: DeltaNet heads and head dims, experts, expert and shared-expert widths
_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=128,
        mlp_only_layers=[0],
    ),
    "small": dict(
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=256,
        mlp_only_layers=[],
    ),
}  # fmt: skip
FULL_ATTENTION_INTERVAL = 4


def tiny_config(size: str, kw: dict[str, Any]) -> Any:
    """The ``Qwen3NextConfig`` of ``size`` over make_tiny's common keys ``kw``."""
    from transformers import Qwen3NextConfig

    num_layers = kw["num_hidden_layers"]
    types = [
        "full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
        for i in range(num_layers)
    ]
    rope = {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25}
    return Qwen3NextConfig(
        **kw,
        **_SHAPES[size],
        layer_types=types,
        rope_parameters=rope,
        linear_conv_kernel_dim=4,
        decoder_sparse_step=1,
        norm_topk_prob=True,
    )


def randomise(model: Any, seed: int) -> None:
    """Seeded values for what HF initialises to constants: the zero-centred RMSNorms (``1 + weight``), the
    DeltaNet's gated output norm (a plain weight, ones) and ``dt_bias`` (ones). Kept tame: decay rates
    ``exp(A_log)`` from 0.02 to 0.5 (long memories, so a state lost between steps shows) and the DeltaNet
    in-projection halved; with HF's random ones float32 rounding alone (HF against itself in float64)
    comes near the 1e-4 logit tolerance of the parity tests."""
    import torch

    gen = torch.Generator().manual_seed(seed + 2)

    def rand(shape: torch.Size, scale: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * scale

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                param.copy_(1.0 + rand(param.shape, 0.3))
            elif name.endswith("norm.weight"):
                param.copy_(rand(param.shape, 0.3))
            elif name.endswith("dt_bias"):
                param.copy_(rand(param.shape, 0.5))
            elif name.endswith("A_log"):
                param.copy_(torch.empty(param.shape).uniform_(0.02, 0.5, generator=gen).log())
            elif name.endswith("in_proj_qkvz.weight"):
                param.mul_(0.5)
