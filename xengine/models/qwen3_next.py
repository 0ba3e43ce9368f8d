"""Qwen3-Next (``Qwen3NextForCausalLM``): gated-DeltaNet linear-attention layers interleaved with gated
full-attention layers (three to one in the released models, ``layer_types``), sparse MoE feed-forward
blocks with a sigmoid-gated shared expert (dense MLPs on ``mlp_only_layers`` / off
``decoder_sparse_step``), and zero-centred RMSNorms (``1 + weight``, folded in at load).

The full-attention layers: ``q_proj`` gives each head's query and an output gate side by side, q/k
RMSNorm, RoPE on the first ``partial_rotary_factor`` of each head, the output times ``sigmoid(gate)``.
The DeltaNet layers (``gated_deltanet.py``) keep a recurrent state per sequence that the engine holds
(``recurrent_state_shapes``) and get no KV cache.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from graph.attention_op import unified_attention
from ops.moe import route
from xengine.layers.linear import Linear, MergedLinear, make_weights_input_major
from xengine.layers.moe import FusedExperts
from xengine.layers.norm import RMSNorm
from xengine.layers.rotary import RotaryEmbedding
from xengine.models.decoder import DecoderForCausalLM, DecoderMLP
from xengine.models.gated_deltanet import GatedDeltaNet
from xengine.models.qwen3_next_config import FULL, Qwen3NextConfig, qwen3_next_config_from_hf
from xengine.models.weights import WeightLoader

# checkpoint entries HF also skips: the multi-token-prediction head (``mtp.py`` loads it to draft)
_IGNORED_PREFIXES = ("mtp.",)
# the MTP head's own tensors, by checkpoint name -> name in ``mtp.MtpLayer``
_MTP_NAMES = {"mtp.fc.": "eh_proj.", "mtp.pre_fc_norm_embedding.": "enorm.",
              "mtp.pre_fc_norm_hidden.": "hnorm.", "mtp.norm.": "post_norm."}  # fmt: skip


class GatedAttention(nn.Module):
    """GQA whose output is gated per channel by ``sigmoid`` of a second half of ``q_proj``."""

    def __init__(self, cfg: Qwen3NextConfig, rotary: RotaryEmbedding, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # its KV cache in the forward context
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # q_proj: per head [query | gate]; loaded as shard 0 (k_proj, v_proj: 1, 2)
        self.qkv_proj = MergedLinear(cfg.hidden_size, [2 * q_size, kv_size, kv_size], bias=cfg.qkv_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.rotary = rotary
        self.scale = cfg.head_dim**-0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q_gate, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q, gate = q_gate.view(n, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q.contiguous())
        k = self.k_norm(k.view(n, self.num_kv_heads, self.head_dim))
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = unified_attention(q, k, v, self.layer_idx, self.scale, None)
        out = out.reshape(n, -1) * torch.sigmoid(gate.reshape(n, -1))
        return self.o_proj(out)


class SharedExpertMoe(nn.Module):
    """Softmax top-k routed experts plus one shared expert scaled by ``sigmoid(shared_expert_gate(x))``."""

    def __init__(self, cfg: Qwen3NextConfig) -> None:
        super().__init__()
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = FusedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = DecoderMLP(replace(cfg, intermediate_size=cfg.shared_expert_intermediate_size))
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.experts(x, weights, ids) + shared


class Qwen3NextLayer(nn.Module):
    """Pre-norm residual layer: ``self_attn`` (full attention) or ``linear_attn`` (gated DeltaNet), then
    the MoE block or dense MLP; HF's module names, so checkpoints load by name."""

    def __init__(self, cfg: Qwen3NextConfig, rotary: RotaryEmbedding, layer_idx: int) -> None:
        super().__init__()
        self.is_linear = cfg.layer_types[layer_idx] != FULL
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, layer_idx)
        else:
            self.self_attn = GatedAttention(cfg, rotary, layer_idx)
        self.mlp = SharedExpertMoe(cfg) if cfg.sparse_layers[layer_idx] else DecoderMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(mlp output, residual stream)``; their sum is the layer's output."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        mixer = self.linear_attn if self.is_linear else self.self_attn
        hidden = mixer(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3NextModel(nn.Module):
    def __init__(self, cfg: Qwen3NextConfig) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(
            cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3NextLayer(cfg, self.rotary, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states of the tokens; attention and the DeltaNet layers read the forward context."""
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3NextForCausalLM(DecoderForCausalLM):
    """The decoder LM's runner interface over ``Qwen3NextModel``, plus the recurrent layers' state shapes."""

    tensor_parallel = False  # its own layers are not split yet

    config: Qwen3NextConfig

    def make_model(self, cfg: Qwen3NextConfig) -> nn.Module:  # type: ignore[override]
        return Qwen3NextModel(cfg)

    @classmethod
    def config_from_hf(cls, hf_config: dict[str, Any]) -> Qwen3NextConfig:
        return qwen3_next_config_from_hf(hf_config)

    def recurrent_state_shapes(self) -> dict[int, tuple[tuple[tuple[int, ...], torch.dtype], ...]]:
        """Per gated-DeltaNet layer (absolute index): the per-sequence shape and dtype of its conv state
        (model dtype) and delta-rule state (float32), in the order its scan takes them."""
        dtype = self.lm_head.weight.dtype
        return {i: self.model.layers[i].linear_attn.state_shapes(dtype) for i in self.config.linear_layers}

    def mtp_block(self, kv_index: int) -> nn.Module:
        """An MTP layer's decoder block: gated full attention (KV cache ``kv_index`` of the MTP pool), MoE."""
        cfg = replace(
            self.config,
            layer_types=(FULL,) * (kv_index + 1),
            sparse_layers=(True,) * (kv_index + 1),
        )
        return Qwen3NextLayer(cfg, self.model.rotary, kv_index)

    def mtp_weight_name(self, name: str, num_mtp_layers: int) -> tuple[int, str] | None:
        """``mtp.fc`` / ``mtp.pre_fc_norm_*`` / ``mtp.norm`` (shared by every layer: -1) and
        ``mtp.layers.{i}.*``."""
        for prefix, ours in _MTP_NAMES.items():
            if name.startswith(prefix):
                return -1, ours + name.removeprefix(prefix)
        if not name.startswith("mtp.layers."):
            return None
        index, _, rest = name.removeprefix("mtp.layers.").partition(".")
        return (int(index), "block." + rest) if index.isdigit() and int(index) < num_mtp_layers else None

    def mtp_after_load(self, layer: nn.Module) -> None:
        """Its norms are zero-centred too: ``1 + weight``, folded in like the model's own."""
        with torch.no_grad():
            for module in layer.modules():
                if isinstance(module, RMSNorm):
                    module.weight.add_(1.0)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.tie_weights()
        make_weights_input_major(self, keep=(self.model.embed_tokens.weight,))
        skip = ("lm_head.weight",) if self.config.tie_word_embeddings else ()
        kept = ((name, t) for name, t in weights if not name.startswith(_IGNORED_PREFIXES))
        WeightLoader(self, skip=skip).load(kept)
        with torch.no_grad():  # zero-centred norms scale by (1 + weight): folded in once here
            for module in self.modules():
                if isinstance(module, RMSNorm):  # not the DeltaNet's gated norm (a plain weight)
                    module.weight.add_(1.0)
