"""Tiny / small Nemotron-H checkpoints for ``xllm model make-tiny --arch nemotron_h``.

Every block kind of the architecture (``hybrid_override_pattern``): Mamba2 mixers (``M``) with grouped
``B`` / ``C`` and a group-wise gated RMSNorm, GQA attention without RoPE (``*``), squared-ReLU MLPs
(``-``) and a sparse MoE block (``E``: sigmoid grouped router with a correction bias, squared-ReLU
experts behind a latent projection, a shared expert). The tiny SSD chunk (16 tokens) is shorter than
the prompts the tests send, so the chunked scan crosses chunk boundaries.
"""

from __future__ import annotations

from typing import Any

PATTERN = {"tiny": "M-M*-E", "small": "M-M-M*-M-M*-E"}
# per size: Mamba2 heads and state, MoE experts and widths
_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        mamba_num_heads=8, mamba_head_dim=32, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=16,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, moe_latent_size=64,
        moe_shared_expert_intermediate_size=128, n_group=2, topk_group=1,
    ),
    "small": dict(
        mamba_num_heads=16, mamba_head_dim=64, n_groups=4, ssm_state_size=64, conv_kernel=4, chunk_size=64,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, moe_latent_size=None,
        moe_shared_expert_intermediate_size=512, n_group=2, topk_group=1,
    ),
}  # fmt: skip
_TYPES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
# HF's Linear init (normal, this std) keeps the Mamba2 step sizes and the squared-ReLU outputs tame
_INITIALIZER_RANGE = 0.05


def tiny_config(size: str, kw: dict[str, Any]) -> Any:
    """The ``NemotronHConfig`` of ``size`` over make_tiny's common keys ``kw`` (its layer count is the
    pattern's, its ``rms_norm_eps`` is Nemotron-H's ``layer_norm_epsilon``, its head is untied)."""
    from transformers import NemotronHConfig

    kw = dict(kw)
    kw.pop("num_hidden_layers")
    kw["layer_norm_epsilon"] = kw.pop("rms_norm_eps")
    kw["initializer_range"] = _INITIALIZER_RANGE
    kw["tie_word_embeddings"] = False  # transformers never ties Nemotron-H's head: say so in the config
    return NemotronHConfig(
        **kw,
        **_SHAPES[size],
        layers_block_type=[_TYPES[c] for c in PATTERN[size]],
        mlp_hidden_act="relu2",
        norm_topk_prob=True,
        routed_scaling_factor=1.5,
        use_conv_bias=True,
    )


def randomise(model: Any, seed: int) -> None:
    """Seeded values for what HF initialises to constants or too small to matter, kept tame: every
    RMSNorm weight (ones) to 0.5 .. 1.5, ``D`` (ones) to 0.1 .. 0.5, ``A_log`` to decay rates 0.1 .. 4,
    ``dt_bias`` to steps ``softplus(dt_bias)`` of 0.02 .. 0.5 (far above ``time_step_min``, a clamp HF
    applies on its chunked path only), and the convolution (weights of std 0.05, zero biases, which
    leave the SSM's share of the output at 1e-3 of the ``D`` skip's) to weights of std 0.5 and biases
    of std 0.2, so the scanned state matters as much as the skip."""
    import torch

    gen = torch.Generator().manual_seed(seed + 3)

    def uniform(shape: torch.Size, lo: float, hi: float) -> torch.Tensor:
        return torch.empty(shape).uniform_(lo, hi, generator=gen)

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                param.copy_(uniform(param.shape, 0.5, 1.5))
            elif name.endswith(".D"):
                param.copy_(uniform(param.shape, 0.1, 0.5))
            elif name.endswith("A_log"):
                param.copy_(uniform(param.shape, 0.1, 4.0).log())
            elif name.endswith("dt_bias"):
                dt = uniform(param.shape, 0.02, 0.5)
                param.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1
            elif name.endswith("conv1d.weight"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
            elif name.endswith("conv1d.bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
