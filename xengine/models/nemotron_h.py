"""Nemotron-H (``NemotronHForCausalLM``): a stack of single-mixer blocks, each ``x + mixer(norm(x))``,
the mixer per layer one of a Mamba2 SSM (``xengine/models/mamba2_mixer.py``), GQA attention without
RoPE, a squared-ReLU MLP or a sparse MoE block (sigmoid grouped router with a correction bias,
squared-ReLU experts, optionally behind a latent down/up projection, plus a shared expert).

Checkpoints name the stack ``backbone`` (NVIDIA's layout, also what transformers writes) or ``model``,
and store the experts one by one (``experts.{e}.up_proj.weight``) or stacked; both load. Like
transformers, the LM head is its own weight whatever ``tie_word_embeddings`` says, and the
multi-token-prediction layers (``mtp.*``) are skipped: this model runs no speculative step.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from graph.attention_op import unified_attention
from graph.forward_context import forward_context
from ops.attention import AttentionMetadata
from ops.moe_relu2 import relu2, relu2_experts
from ops.recurrent_metadata import RecurrentMetadata
from xengine.layers.linear import Linear, MergedLinear, make_weights_input_major
from xengine.layers.moe import GroupedTopkRouter
from xengine.layers.norm import RMSNorm
from xengine.models.base import BaseCausalLM
from xengine.models.mamba2_mixer import Mamba2Mixer, StateSpec
from xengine.models.nemotron_h_config import (
    ATTENTION,
    MAMBA,
    MLP,
    NemotronHConfig,
    nemotron_h_config_from_hf,
)
from xengine.models.weights import WeightLoader
from xengine.parallel.state import get_expert_parallel

_EXPERT = re.compile(r"^(.+\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$")


class NemotronHAttention(nn.Module):
    """Causal GQA without position encoding and without biases."""

    def __init__(self, cfg: NemotronHConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # its KV cache in the forward context
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, [q_size, kv_size, kv_size], bias=False)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim**-0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = unified_attention(q, k, v, self.layer_idx, self.scale, None)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class NemotronHMLP(nn.Module):
    """``down(relu(up(x))^2)``: no gate."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu2(self.up_proj(x)))


class Relu2Experts(nn.Module):
    """``num_experts`` squared-ReLU MLPs with stacked weights (``up_proj`` ``[E, I, D]``, ``down_proj``
    ``[E, D, I]``: transformers' layout); ``forward`` runs each token's top-k through the MoE ops."""

    def __init__(self, num_experts: int, dim: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, intermediate_size))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return relu2_experts(x, topk_weights, topk_ids, self.up_proj, self.down_proj)


class NemotronHMoE(nn.Module):
    """``fc2(experts(fc1(x))) + shared_experts(x)``, the latent projections ``fc1`` / ``fc2`` only
    with ``moe_latent_size``."""

    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        if get_expert_parallel() is not None:
            raise ValueError(
                "expert parallelism is not supported for Nemotron-H (its squared-ReLU experts run on "
                "one process); set parallel.expert_parallel_size to 1"
            )
        self.gate = GroupedTopkRouter.from_config(cfg)
        latent = cfg.moe_latent_size
        self.experts = Relu2Experts(cfg.num_experts, latent or cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_experts = NemotronHMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, cfg.mlp_bias)
        self.fc1_latent_proj = Linear(cfg.hidden_size, latent, bias=cfg.mlp_bias) if latent else None
        self.fc2_latent_proj = Linear(latent, cfg.hidden_size, bias=cfg.mlp_bias) if latent else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        routed = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        routed = self.experts(routed, weights, ids)
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)
        return routed + self.shared_experts(x)


class NemotronHBlock(nn.Module):
    """One layer: a pre-norm and the mixer of the layer's kind (``layer_types``)."""

    def __init__(self, cfg: NemotronHConfig, layer_idx: int) -> None:
        super().__init__()
        kind = cfg.layer_types[layer_idx]
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        if kind == MAMBA:
            self.mixer: nn.Module = Mamba2Mixer(cfg, layer_idx)
        elif kind == ATTENTION:
            self.mixer = NemotronHAttention(cfg, layer_idx)
        elif kind == MLP:
            self.mixer = NemotronHMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        else:
            self.mixer = NemotronHMoE(cfg)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(mixer output, residual stream)``; their sum is the block's output."""
        if residual is None:
            residual, hidden = hidden, self.norm(hidden)
        else:
            hidden, residual = self.norm(hidden, residual)
        return self.mixer(hidden), residual


class NemotronHModel(nn.Module):
    """Embeddings, the blocks, the final norm (``norm_f``)."""

    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(NemotronHBlock(cfg, i) for i in range(cfg.num_layers))
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embeddings(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual)
        hidden, _ = self.norm_f(hidden, residual)
        return hidden


class NemotronHForCausalLM(BaseCausalLM):
    """Nemotron-H with an untied LM head; its Mamba2 layers' states are declared by
    ``recurrent_state_shapes`` and held by the engine."""

    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = NemotronHModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head.float_output = True

    @classmethod
    def config_from_hf(cls, hf_config: dict[str, Any]) -> NemotronHConfig:
        return nemotron_h_config_from_hf(hf_config)

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> NemotronHForCausalLM:
        return cls(cls.config_from_hf(hf_config))

    def recurrent_state_shapes(self) -> dict[int, tuple[StateSpec, ...]]:
        """Per Mamba2 layer (absolute index): its conv state and SSM state, per sequence."""
        return {
            i: layer.mixer.state_shapes()
            for i, layer in enumerate(self.model.layers)
            if isinstance(layer.mixer, Mamba2Mixer)
        }

    def kv_layers(self) -> list[int]:
        """The layers that keep attention KV (the MLP / MoE blocks keep none)."""
        return [i for i, layer in enumerate(self.model.layers) if isinstance(layer.mixer, NemotronHAttention)]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        *,
        recurrent: RecurrentMetadata | None = None,
        states: list[tuple[torch.Tensor, ...] | None] | None = None,
    ) -> torch.Tensor:
        """One forward over ``meta``'s batch (sets the forward context); ``recurrent`` / ``states``:
        the step's sequences and each layer's state tensors (without them the Mamba2 layers run all
        rows as one sequence from a zero state)."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"expected {len(self.model.layers)} KV caches, got {len(kv_caches)}")
        with forward_context(meta, kv_caches, input_ids.shape[0], recurrent=recurrent, states=states):
            return self.forward_tokens(input_ids, positions)

    def forward_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Positions are unused: attention has no position encoding, the Mamba2 layers carry order."""
        return self.model(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        make_weights_input_major(self)
        WeightLoader(self).load(_stack_experts(_canonical_names(weights), self.config.num_experts))


def _canonical_names(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``backbone.*`` read as ``model.*``; the multi-token-prediction layers (``mtp.*``) dropped."""
    for name, tensor in weights:
        if name.startswith("mtp."):
            continue
        yield ("model." + name[len("backbone.") :] if name.startswith("backbone.") else name), tensor


def _stack_experts(
    weights: Iterable[tuple[str, torch.Tensor]], num_experts: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Per-expert tensors (``<...>.experts.{e}.up_proj.weight``) gathered into the stacked
    ``<...>.experts.up_proj`` once every expert of that projection has come (one layer's experts are
    held at a time in the usual checkpoint order)."""
    pending: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in weights:
        match = _EXPERT.match(name)
        if match is None:
            yield name, tensor
            continue
        path, expert, proj = match.group(1), int(match.group(2)), match.group(3)
        stacked = f"{path}.{proj}"
        parts = pending.setdefault(stacked, {})
        if expert in parts or not 0 <= expert < num_experts:
            raise ValueError(f"checkpoint weight {name!r}: expert out of range or given twice")
        parts[expert] = tensor
        if len(parts) == num_experts:
            yield stacked, torch.stack([parts[e] for e in range(num_experts)])
            del pending[stacked]
    if pending:
        raise ValueError(f"checkpoint is missing experts of {', '.join(sorted(pending))}")
