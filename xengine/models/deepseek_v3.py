"""DeepSeek-V3: MLA attention over a compressed latent KV cache, dense first layers, then MoE blocks
with a grouped bias-corrected router and shared experts. The multi-token-prediction layers in the
checkpoint (``model.layers.{num_hidden_layers + i}...``) are not part of the model: ``mtp.py`` loads
them for speculative decoding (``mtp_block``, ``mtp_weight_name``)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from xengine.layers.mla import MultiLatentAttention
from xengine.layers.moe import FusedExperts, GroupedTopkRouter, SharedExpertMoeBlock
from xengine.layers.rotary import RotaryEmbedding
from xengine.models.decoder import DecoderForCausalLM, DecoderLayer, DecoderMLP
from xengine.models.deepseek_config import DeepseekV3Config, deepseek_v3_config_from_hf

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_MTP_OWN = ("enorm.", "hnorm.", "eh_proj.")
_MTP_SHARED = ("embed_tokens.", "shared_head.head.")  # the target's embedding and head


class DeepseekV3ForCausalLM(DecoderForCausalLM):
    config: DeepseekV3Config

    @classmethod
    def config_from_hf(cls, hf_config: dict[str, Any]) -> DeepseekV3Config:
        return deepseek_v3_config_from_hf(hf_config)

    def make_attention(self, layer_idx: int, rotary: RotaryEmbedding) -> nn.Module:
        cfg = self.config
        return MultiLatentAttention(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.q_lora_rank,
            cfg.kv_lora_rank,
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
            cfg.attention_scale,
            cfg.attention_bias,
            rotary,
            layer_idx,
        )

    def make_mlp(self, layer_idx: int) -> nn.Module | None:
        cfg = self.config
        if not cfg.sparse_layers[layer_idx]:
            return None
        return self._moe()

    def _moe(self) -> nn.Module:
        cfg = self.config
        router = GroupedTopkRouter.from_config(cfg)
        experts = FusedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        shared_size = cfg.moe_intermediate_size * cfg.n_shared_experts
        shared = DecoderMLP(dataclasses.replace(cfg, intermediate_size=shared_size))
        return SharedExpertMoeBlock(router, experts, shared)

    def mtp_block(self, kv_index: int) -> nn.Module:
        """An MTP layer's decoder block: MLA attention (KV cache ``kv_index`` of the MTP pool) and MoE."""
        rotary = self.model.rotary
        return DecoderLayer(self.config, rotary, kv_index, self._moe(), self.make_attention(kv_index, rotary))

    def mtp_weight_name(self, name: str, num_mtp_layers: int) -> tuple[int, str] | None:
        """``model.layers.{num_hidden_layers + i}.*`` -> MTP layer ``i``'s name (``mtp.MtpLayer``)."""
        match = _LAYER.match(name)
        if match is None:
            return None
        index = int(match.group(1)) - self.config.num_layers
        if not 0 <= index < num_mtp_layers:
            return None
        rest = name[match.end() :]
        if rest.startswith(_MTP_SHARED):
            return None
        if rest.startswith("shared_head.norm."):
            return index, "post_norm." + rest.removeprefix("shared_head.norm.")
        return index, rest if rest.startswith(_MTP_OWN) else "block." + rest

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        num_layers = self.config.num_layers

        def main_layers_only() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                match = _LAYER.match(name)
                if match is None or int(match.group(1)) < num_layers:
                    yield name, tensor

        super().load_weights(main_layers_only())
