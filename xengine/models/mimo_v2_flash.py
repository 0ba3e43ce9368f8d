"""MiMo-V2-Flash (``MiMoV2FlashForCausalLM``): sliding-window and full-attention layers interleaved
(``layer_types``), the sliding ones with twice the KV heads and a learned attention sink per query head;
query/key heads wider than value heads (192 / 128 in the release); values scaled by
``attention_value_scale``; partial RoPE with its own theta per layer kind; a dense first layer, then
MoE layers with DeepSeek-V3's sigmoid, bias-corrected grouped router and no shared experts.

The paged KV cache holds K and V rows of one width, so values are zero-padded to the query/key head
dim before attention and the output sliced back: exact (the padded columns are zeros in, zeros out),
at the cost of ``(head_dim - v_head_dim) / (2 * head_dim)`` of the KV bytes (a sixth for 192 / 128).
The two layer kinds' KV geometries differ, so their KV lives in two pools (``kv_cache_heads``,
``xengine/kv_setup.py``; docs/hybrid_memory.md).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from graph.attention_op import unified_attention
from xengine.layers.linear import Linear, MergedLinear
from xengine.layers.moe import FusedExperts, GroupedTopkRouter
from xengine.layers.rotary import RotaryEmbedding
from xengine.models.decoder import DecoderForCausalLM, DecoderLayer, DecoderMLP
from xengine.models.info import ModelInfo
from xengine.models.mimo_v2_flash_config import (
    SWA_KV_HEAD_FACTOR,
    MiMoV2FlashConfig,
    mimo_v2_flash_config_from_hf,
)

_MTP = re.compile(r"^model\.mtp\.")  # the multi-token-prediction layers (``mtp.py`` loads them to draft)
_MTP_LAYER = re.compile(r"^model\.mtp\.layers\.(\d+)\.")
# MTP layer names that differ from ``mtp.MtpLayer``'s (a decoder block between MTP's own norms)
_MTP_RENAMES = (("final_layernorm.", "post_norm."), ("pre_mlp_layernorm.", "block.post_attention_layernorm."),
                ("self_attn.attention_sink_bias", "block.self_attn.sinks"))  # fmt: skip
_SINK_NAME = ".self_attn.attention_sink_bias"  # the released checkpoints' name of the sinks


class MiMoAttention(nn.Module):
    """GQA over zero-padded values, with per-head sinks on the sliding-window layers."""

    def __init__(self, cfg: MiMoV2FlashConfig, rotary: RotaryEmbedding, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.sliding_window = cfg.sliding_windows[layer_idx]
        swa = self.sliding_window is not None
        self.num_heads, self.head_dim, self.v_head_dim = cfg.num_heads, cfg.head_dim, cfg.v_head_dim
        self.num_kv_heads = cfg.window_num_kv_heads if swa else cfg.num_kv_heads
        q_size, k_size = cfg.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        v_size = self.num_kv_heads * cfg.v_head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, [q_size, k_size, v_size], bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.num_heads * cfg.v_head_dim, cfg.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads)) if swa else None
        self.rotary = rotary
        self.scale = cfg.head_dim**-0.5
        self.value_scale = cfg.attention_value_scale

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.v_head_dim) * self.value_scale
        q, k = self.rotary(positions, q, k)
        v = F.pad(v, (0, self.head_dim - self.v_head_dim))  # the cache's row width; zeros attend to zeros
        sinks = None if self.sinks is None else self.sinks.float()
        out = unified_attention(q, k, v, self.layer_idx, self.scale, self.sliding_window, sinks)
        return self.o_proj(out[..., : self.v_head_dim].reshape(num_tokens, self.num_heads * self.v_head_dim))


class RoutedMoeBlock(nn.Module):
    """Grouped-router MoE without shared experts: ``experts(x)`` with the router's top-k weights."""

    def __init__(self, gate: GroupedTopkRouter, experts: FusedExperts) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(hidden)
        return self.experts(hidden, weights, ids)


class MiMoV2FlashForCausalLM(DecoderForCausalLM):
    tensor_parallel = False  # its own layers are not split yet
    config: MiMoV2FlashConfig

    @classmethod
    def config_from_hf(cls, hf_config: dict[str, Any]) -> MiMoV2FlashConfig:
        return mimo_v2_flash_config_from_hf(hf_config)

    @classmethod
    def kv_cache_heads(cls, info: ModelInfo) -> tuple[tuple[int, int], tuple[int, int]]:
        """``(num_kv_heads, head_dim)`` of one token's KV cache entry in a full-attention layer and in a
        sliding-window layer (twice the heads; V zero-padded to the query/key head dim in both)."""
        return (info.num_kv_heads, info.head_dim), (SWA_KV_HEAD_FACTOR * info.num_kv_heads, info.head_dim)

    def _window_rotary(self) -> RotaryEmbedding:
        """The sliding-window layers' RoPE (their own theta and rotary dims), built once."""
        rotary = getattr(self, "window_rotary", None)
        if rotary is None:
            cfg = self.config
            rotary = RotaryEmbedding(
                cfg.window_rotary_dim, cfg.max_position_embeddings, cfg.window_rope_theta
            )
            self.window_rotary = rotary
        return rotary

    def make_attention(self, layer_idx: int, rotary: RotaryEmbedding) -> nn.Module:
        if self.config.sliding_windows[layer_idx] is not None:
            rotary = self._window_rotary()
        return MiMoAttention(self.config, rotary, layer_idx)

    def make_mlp(self, layer_idx: int) -> nn.Module | None:
        cfg = self.config
        if not cfg.sparse_layers[layer_idx]:
            return None
        router = GroupedTopkRouter.from_config(cfg)
        return RoutedMoeBlock(
            router, FusedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        )

    def mtp_block(self, kv_index: int) -> nn.Module:
        """An MTP layer's decoder block: sliding-window attention with sinks (the window layers' shapes and
        RoPE; KV cache ``kv_index`` of the MTP pool) and the dense MLP."""
        cfg = self.config
        window = next(w for w in cfg.sliding_windows if w is not None)
        block_cfg = dataclasses.replace(cfg, sliding_windows=(window,) * (kv_index + 1))
        rotary = self._window_rotary()
        attn = MiMoAttention(block_cfg, rotary, kv_index)
        return DecoderLayer(block_cfg, rotary, kv_index, DecoderMLP(cfg), attn)

    def mtp_kv_info(self, info: ModelInfo, num_layers: int) -> ModelInfo:
        """The MTP pool's geometry: ``num_layers`` sliding-window layers' (twice the KV heads)."""
        return dataclasses.replace(
            info, num_layers=num_layers, num_kv_heads=SWA_KV_HEAD_FACTOR * info.num_kv_heads
        )

    def mtp_weight_name(self, name: str, num_mtp_layers: int) -> tuple[int, str] | None:
        """``model.mtp.layers.{i}.*`` -> MTP layer ``i``'s name (``mtp.MtpLayer``)."""
        match = _MTP_LAYER.match(name)
        if match is None or int(match.group(1)) >= num_mtp_layers:
            return None
        rest = name[match.end() :]
        for theirs, ours in _MTP_RENAMES:
            if rest.startswith(theirs):
                return int(match.group(1)), ours + rest.removeprefix(theirs)
        return int(match.group(1)), rest if rest.startswith(
            ("enorm.", "hnorm.", "eh_proj.")
        ) else "block." + rest

    def set_max_model_len(self, max_model_len: int) -> None:
        super().set_max_model_len(max_model_len)
        self._window_rotary().set_max_len(max_model_len)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if _MTP.match(name):
                    continue
                if name.endswith(_SINK_NAME):
                    name = name[: -len(_SINK_NAME)] + ".self_attn.sinks"
                yield name, tensor

        super().load_weights(renamed())
