"""Reference MoE ops: sort rows by expert, one matmul per expert that has rows, weighted un-permute.

Matches HF ``transformers``' default experts path (``grouped_mm``): rows sorted by expert, the top-k
expert outputs of a token summed in slot order after scaling (``view(T, k, H).sum(1)``), which is
deterministic on every device (no ``index_add_`` atomics).
"""

from __future__ import annotations

import torch

from ops.moe_types import DispatchedTokens
from ops.torch_ref.activation import silu_and_mul


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def route_grouped(
    logits: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    correction_bias: torch.Tensor | None,
    renormalize: bool,
    scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_experts = logits.shape
    scores = logits.float().sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias
    per_group = choice.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores = per_group.topk(min(2, per_group.shape[-1]), dim=-1)[0].sum(dim=-1)
    group_ids = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_ids, 1).bool()
    expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, num_experts // num_groups).reshape(num_tokens, -1)
    ids = torch.topk(choice.masked_fill(~expert_mask, float("-inf")), k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling_factor, ids


def dispatch(hidden: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> DispatchedTokens:
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts)
    return DispatchedTokens(
        hidden=hidden[order // top_k],
        tokens_per_expert=counts.tolist(),
        order=order,
        num_tokens=num_tokens,
        top_k=top_k,
    )


def grouped_matmul(x: torch.Tensor, tokens_per_expert: list[int], weight: torch.Tensor) -> torch.Tensor:
    out = x.new_empty(x.shape[0], weight.shape[1])
    start = 0
    for expert, count in enumerate(tokens_per_expert):
        if count:
            end = start + count
            torch.mm(x[start:end], weight[expert].t(), out=out[start:end])
            start = end
    return out


def expert_swiglu(
    x: torch.Tensor, tokens_per_expert: list[int], w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    return grouped_matmul(silu_and_mul(grouped_matmul(x, tokens_per_expert, w13)), tokens_per_expert, w2)


def combine(
    expert_out: torch.Tensor, dispatched: DispatchedTokens, topk_weights: torch.Tensor
) -> torch.Tensor:
    weighted = expert_out * topk_weights.reshape(-1)[dispatched.order].unsqueeze(-1)
    unpermuted = torch.empty_like(weighted)
    unpermuted[dispatched.order] = weighted
    hidden_size = expert_out.shape[-1]
    return unpermuted.view(dispatched.num_tokens, dispatched.top_k, hidden_size).sum(dim=1)
