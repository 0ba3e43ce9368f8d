"""Mixture-of-experts facade: ``route``, ``dispatch``, grouped expert matmul (``expert_swiglu``),
``combine``, each its own op so a backend (or expert parallelism's all-to-all dispatch and combine)
can replace one without the others.

Expert weights are stacked: ``w13`` ``[E, 2 * I, H]`` (gate rows then up rows, as HF's fused
``gate_up_proj``) and ``w2`` ``[E, H, I]``. ``fused_experts`` runs dispatch, expert SwiGLU and combine;
inside a compiled graph it is one opaque custom op, since the per-expert row counts are data.
See ``docs/expert_parallel.md``.
"""

from __future__ import annotations

import torch

from ops.moe_types import DispatchedTokens
from ops.opaque_op import opaque_op
from ops.registry import REFERENCE, get_op, register_op


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in float32, top-``top_k``, optionally renormalised to sum to 1, weights
    cast back to ``logits.dtype`` (HF's Qwen2/3-MoE router). Returns ``(weights [T, k], ids [T, k] int64)``,
    experts in descending probability."""
    return get_op("moe_route")(logits, top_k, renormalize)


def route_grouped(
    logits: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    correction_bias: torch.Tensor | None,
    renormalize: bool,
    scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router (HF ``DeepseekV3TopkRouter``): sigmoid scores; experts are chosen on
    ``score + correction_bias`` within the ``topk_groups`` groups (of ``num_groups`` equal ones) whose two
    best experts score highest; the weights are the chosen experts' plain scores, renormalised when asked,
    times ``scaling_factor``. Returns ``(weights [T, k] float32, ids [T, k] int64)``."""
    return get_op("moe_route_grouped")(
        logits, top_k, num_groups, topk_groups, correction_bias, renormalize, scaling_factor
    )


def dispatch(hidden: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> DispatchedTokens:
    """Group ``hidden`` ([T, H]) rows by their experts ``topk_ids`` ([T, k]) for ``grouped_matmul``."""
    return get_op("moe_dispatch")(hidden, topk_ids, num_experts)


def grouped_matmul(x: torch.Tensor, tokens_per_expert: list[int], weight: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` ([N, in], grouped by expert as ``dispatch`` leaves them) times their expert's
    ``weight[e]`` ([E, out, in]) transposed: [N, out]."""
    return get_op("moe_grouped_matmul")(x, tokens_per_expert, weight)


def expert_swiglu(
    x: torch.Tensor, tokens_per_expert: list[int], w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """Each expert's SwiGLU MLP ``w2 @ (silu(gate) * up)`` over its rows of ``x`` ([N, H] -> [N, H])."""
    return get_op("moe_expert_swiglu")(x, tokens_per_expert, w13, w2)


def combine(
    expert_out: torch.Tensor, dispatched: DispatchedTokens, topk_weights: torch.Tensor
) -> torch.Tensor:
    """Inverse of ``dispatch``: ``out[t] = sum_j topk_weights[t, j] * expert_out[row of (t, j)]``: [T, H]."""
    return get_op("moe_combine")(expert_out, dispatched, topk_weights)


def fused_experts(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """The whole expert part of a sparse MoE layer after routing: dispatch, expert SwiGLU, combine.
    Returns ``hidden.dtype`` (the combine itself runs in the promoted dtype of the weights)."""
    if torch.compiler.is_compiling():
        return _fused_experts_op(hidden, topk_weights, topk_ids, w13, w2)
    return get_op("moe_fused_experts")(hidden, topk_weights, topk_ids, w13, w2)


def _composed_fused_experts(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """The reference ``moe_fused_experts``: the three steps through this facade, so a backend that
    registers only some of them gets them used. Registered here (not in ``ops/torch_ref``) because it
    calls the facade, which the backends must not import."""
    if hidden.shape[0] == 0:
        return torch.empty_like(hidden)
    dispatched = dispatch(hidden, topk_ids, w13.shape[0])
    out = expert_swiglu(dispatched.hidden, dispatched.tokens_per_expert, w13, w2)
    return combine(out, dispatched, topk_weights).to(hidden.dtype)


register_op("moe_fused_experts", REFERENCE, _composed_fused_experts)


def _fused_experts_fake(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    return torch.empty_like(hidden)


@opaque_op(
    "moe_fused_experts(Tensor hidden, Tensor topk_weights, Tensor topk_ids, Tensor w13, Tensor w2) -> Tensor",
    _fused_experts_fake,
)
def _fused_experts_op(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    return get_op("moe_fused_experts")(hidden, topk_weights, topk_ids, w13, w2)
