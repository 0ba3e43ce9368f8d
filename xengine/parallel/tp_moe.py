"""An MoE layer's experts under tensor parallelism: every rank holds the same tokens, so no all-to-all.

With ``tensor_parallel_size = N`` the experts are split over the N ranks by expert parallelism
(``ExpertShard``: whole experts per rank, so each expert's matmuls keep their full width), and after the
attention's all-reduce every rank holds every token. Each rank therefore runs its own experts on the
(token, expert) pairs routed to them, weights them, and the shared-memory all-reduce sums the N partial
outputs: one collective per layer instead of the expert-parallel path's count exchange, two
all-to-alls and an all-gather over gloo.
"""

from __future__ import annotations

from typing import Any

import torch

from ops.moe import fused_experts
from xengine.parallel.state import ExpertParallel
from xengine.parallel.tensor import TensorParallel, all_reduce


def tp_experts(
    ep: ExpertParallel,
    tp: TensorParallel,
    shard: Any,  # ``ep_moe.ExpertShard`` (which calls this)
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Rank ``ep.rank``'s experts' share of the layer's output, summed over the group ([T, H])."""
    top_k = topk_ids.shape[1]
    phys = shard.to_physical(topk_ids, 0).reshape(-1)
    first = ep.rank * shard.num_slots
    mine = ((phys >= first) & (phys < first + shard.num_slots)).nonzero().squeeze(1)
    tokens = mine // top_k
    out = torch.zeros_like(hidden)
    if mine.numel():
        ids = (phys[mine] - first).unsqueeze(1)
        weights = topk_weights.reshape(-1)[mine].unsqueeze(1)
        module = shard.module
        rows = fused_experts(hidden[tokens], weights, ids, module.gate_up_proj, module.down_proj)
        out.index_add_(0, tokens, rows.to(out.dtype))
    ep.comm.num_layer_calls += 1
    return all_reduce(out)
