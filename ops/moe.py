"""Mixture-of-experts facade: routing, dispatch, grouped expert matmul, combine.

A sparse MoE layer is four steps, each its own op so a backend can replace one without the others:

1. ``route``: router logits ``[T, E]`` -> top-k ``(weights [T, k], ids [T, k])``.
2. ``dispatch``: copy each token once per chosen expert, rows grouped by expert id (a permutation on
   one process). Expert parallelism slots in here: a distributed dispatch sends each expert's rows to
   the rank that owns it (all-to-all) and returns the rows of the local experts in the same
   ``DispatchedTokens`` shape; the returned object is the handle ``combine`` needs to send them back.
3. ``expert_swiglu`` (two ``grouped_matmul`` around ``silu_and_mul``): every expert's MLP on its rows.
4. ``combine``: put rows back in token order, scale by the routing weights, sum the top-k rows of each
   token (the inverse of ``dispatch``; the distributed version does the reverse all-to-all first).

Expert weights are stacked: ``w13`` ``[E, 2 * I, H]`` (gate rows then up rows, as HF's fused
``gate_up_proj``) and ``w2`` ``[E, H, I]``. ``fused_experts`` runs steps 2-4; inside a compiled graph
it is one opaque custom op (``xllm::moe_fused_experts``), since the per-expert row counts are data.
Redundant experts (EPLB) map logical ids to physical ones between ``route`` and ``dispatch``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ops.opaque_op import opaque_op
from ops.registry import get_op


@dataclass
class DispatchedTokens:
    """Rows for the experts of this process, grouped by expert, and how to put them back.

    ``hidden[r]`` is token ``order[r] // top_k``'s input for its ``order[r] % top_k``-th expert; the rows
    of expert ``e`` follow those of expert ``e - 1`` (``tokens_per_expert[e]`` of them, host ints so
    backends can loop or size kernels without a device sync)."""

    hidden: torch.Tensor  # [N, H]
    tokens_per_expert: list[int]  # [E]
    order: torch.Tensor  # [N] int64, flat (token * top_k + slot) index of each row
    num_tokens: int
    top_k: int


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
