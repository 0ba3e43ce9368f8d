"""Sparse mixture-of-experts layers over the ``ops.moe`` facade.

``FusedExperts`` holds every expert's weights stacked (``gate_up_proj`` ``[E, 2 * I, H]``,
``down_proj`` ``[E, H, I]``: the names and layout of HF's fused experts), so checkpoints in the fused
layout load by name and per-expert checkpoints (``experts.{e}.gate_proj.weight`` ...) load expert by
expert through ``load_expert``. ``SparseMoeBlock`` is the Qwen2/3-MoE block: a linear router, top-k
routing, the experts; ``SharedExpertMoeBlock`` the DeepSeek-V3 one: a grouped, bias-corrected router, the
routed experts and always-on shared experts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ops.moe import fused_experts, route, route_grouped
from xengine.layers.checkpoint_tensor import LazyTensor, materialize, narrow
from xengine.layers.linear import Linear
from xengine.parallel.ep_moe import ExpertShard, ep_fused_experts
from xengine.parallel.state import get_expert_parallel

# per-expert checkpoint projection -> (stacked parameter, shard within the expert's rows)
EXPERT_PROJECTIONS: dict[str, tuple[str, int]] = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
_PROJECTION_OF = {target: name for name, target in EXPERT_PROJECTIONS.items()}


class FusedExperts(nn.Module):
    """``num_experts`` SwiGLU MLPs with stacked weights; ``forward`` runs each token's top-k of them."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        # expert parallel: this rank holds only the experts of its physical slots (``ExpertShard``)
        ep = get_expert_parallel()
        self.shard = ExpertShard(ep, num_experts, hidden_size, intermediate_size) if ep else None
        rows = self.shard.num_slots if self.shard else num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(rows, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(rows, hidden_size, intermediate_size))
        if self.shard is not None:
            self.shard.module = self

    def forward(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        if self.shard is not None:
            return ep_fused_experts(hidden, topk_weights, topk_ids, self.shard.layer_index)
        return fused_experts(hidden, topk_weights, topk_ids, self.gate_up_proj, self.down_proj)

    def load_stacked(self, param_name: str, tensor: torch.Tensor | LazyTensor) -> None:
        """A checkpoint's whole stacked tensor (HF's fused ``gate_up_proj`` / ``down_proj``, every expert);
        an expert-parallel rank reads only its experts' rows of it."""
        param = getattr(self, param_name)
        if tuple(tensor.shape) != (self.num_experts, *param.shape[1:]):
            raise ValueError(
                f"experts {param_name}: expected shape {(self.num_experts, *param.shape[1:])}, "
                f"got {tuple(tensor.shape)}"
            )
        if self.shard is None:
            with torch.no_grad():
                param.copy_(materialize(tensor))
            return
        rows = param.shape[1] if param_name == "down_proj" else self.intermediate_size
        for expert in range(self.num_experts):
            if not self.shard.needs(expert):  # another rank's: not even read from the file
                continue
            whole = narrow(tensor, 0, expert, 1)[0]
            for part in range(1 if param_name == "down_proj" else 2):
                piece = whole[part * rows : (part + 1) * rows]
                self.load_expert(expert, _PROJECTION_OF[(param_name, part)], piece)

    def num_shards(self, param_name: str) -> int:
        """Checkpoint tensors that fill ``param_name`` when loaded expert by expert."""
        return self.num_experts * (2 if param_name == "gate_up_proj" else 1)

    def load_expert(self, expert: int, projection: str, tensor: torch.Tensor | LazyTensor) -> tuple[str, int]:
        """Copy one expert's ``gate_proj`` / ``up_proj`` / ``down_proj`` weight into the stacked
        parameter; returns ``(parameter name, shard index)`` for the loader's completeness check."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range: the model has {self.num_experts} experts")
        param_name, part = EXPERT_PROJECTIONS[projection]
        param = getattr(self, param_name)
        rows = self.intermediate_size if param_name == "gate_up_proj" else param.shape[1]
        expected = (rows, param.shape[2])
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"expert {expert} {projection}: expected shape {expected}, got {tuple(tensor.shape)}"
            )
        if self.shard is not None and not self.shard.needs(expert):  # another rank's: left unread
            slots = []
        else:
            tensor = materialize(tensor)
            slots = (
                [expert] if self.shard is None else self.shard.load(expert, param_name, part, rows, tensor)
            )
        with torch.no_grad():
            for slot in slots:
                param[slot, part * rows : (part + 1) * rows].copy_(tensor)
        shards_per_expert = 2 if param_name == "gate_up_proj" else 1
        return param_name, expert * shards_per_expert + part


class SparseMoeBlock(nn.Module):
    """Router (``gate``: hidden -> one logit per expert), top-k routing, experts (Qwen2/3-MoE)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = Linear(hidden_size, num_experts, bias=False)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(hidden), self.top_k, self.renormalize)
        return self.experts(hidden, weights, ids)


class GroupedTopkRouter(nn.Module):
    """DeepSeek-V3's router: float32 logits, sigmoid scores, bias-corrected grouped top-k
    (``ops.moe.route_grouped``). ``e_score_correction_bias`` is a parameter so the checkpoint loads it."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        num_groups: int,
        topk_groups: int,
        renormalize: bool,
        scaling_factor: float,
    ) -> None:
        super().__init__()
        if num_experts % num_groups:
            raise ValueError(f"n_group ({num_groups}) must divide the number of experts ({num_experts})")
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))
        self.top_k, self.num_groups, self.topk_groups = top_k, num_groups, topk_groups
        self.renormalize, self.scaling_factor = renormalize, scaling_factor

    @classmethod
    def from_config(cls, cfg: Any) -> GroupedTopkRouter:
        """From a config with DeepSeek-V3's routing fields (``num_experts``, ``num_experts_per_tok``,
        ``n_group``, ``topk_group``, ``norm_topk_prob``, ``routed_scaling_factor``)."""
        return cls(
            cfg.hidden_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.n_group,
            cfg.topk_group,
            cfg.norm_topk_prob,
            cfg.routed_scaling_factor,
        )

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = torch.nn.functional.linear(hidden.float(), self.weight.float())
        return route_grouped(
            logits,
            self.top_k,
            self.num_groups,
            self.topk_groups,
            self.e_score_correction_bias.float(),
            self.renormalize,
            self.scaling_factor,
        )


class SharedExpertMoeBlock(nn.Module):
    """Routed experts plus always-on shared experts (DeepSeek-V2/V3): ``experts(x) + shared_experts(x)``."""

    def __init__(self, gate: GroupedTopkRouter, experts: FusedExperts, shared_experts: nn.Module) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.shared_experts = shared_experts

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(hidden)
        return self.experts(hidden, weights, ids) + self.shared_experts(hidden)
