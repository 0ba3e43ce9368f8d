"""Squared-ReLU experts (Nemotron-H's MoE): each token's top-k experts ``down(relu(up(x))^2)``, no gate.

One opaque op (``xllm::moe_relu2_experts``) so a compiled graph keeps its data-dependent dispatch eager,
like ``moe_fused_experts``; it composes the MoE steps of ``ops/moe.py``."""

from __future__ import annotations

import torch

from ops.moe import combine, dispatch, grouped_matmul
from ops.opaque_op import opaque_op


def relu2(x: torch.Tensor) -> torch.Tensor:
    """``relu(x) ** 2``."""
    return torch.relu(x).square()


def _fake(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, up: torch.Tensor,
          down: torch.Tensor) -> torch.Tensor:  # fmt: skip
    return hidden.new_empty(hidden.shape)


@opaque_op(
    "moe_relu2_experts(Tensor hidden, Tensor topk_weights, Tensor topk_ids, Tensor up, Tensor down) -> Tensor",
    _fake,
)
def relu2_experts(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """``hidden`` ``[T, D]``; ``up`` ``[E, I, D]``, ``down`` ``[E, D, I]`` (stacked expert weights)."""
    if hidden.shape[0] == 0:
        return torch.empty_like(hidden)
    routed = dispatch(hidden, topk_ids, up.shape[0])
    counts = routed.tokens_per_expert
    out = grouped_matmul(relu2(grouped_matmul(routed.hidden, counts, up)), counts, down)
    return combine(out, routed, topk_weights).to(hidden.dtype)
