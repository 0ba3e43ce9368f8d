"""Qwen3-MoE: the Qwen3 decoder (q/k RMSNorm) with sparse MoE blocks on the layers HF makes sparse."""

from __future__ import annotations

from typing import Any

from torch import nn

from xengine.layers.moe import SparseMoeBlock
from xengine.models.decoder import DecoderForCausalLM
from xengine.models.decoder_config import decoder_config_from_hf
from xengine.models.moe_config import MoeDecoderConfig, moe_config_from_hf


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    """Router softmax in float32, top-k, renormalised when ``norm_topk_prob`` (HF's
    ``Qwen3MoeSparseMoeBlock``); no shared experts. Layers in ``mlp_only_layers`` or off the
    ``decoder_sparse_step`` keep the dense MLP of ``intermediate_size``."""

    config: MoeDecoderConfig

    @classmethod
    def config_from_hf(cls, hf_config: dict[str, Any]) -> MoeDecoderConfig:
        return moe_config_from_hf(decoder_config_from_hf(hf_config, qk_norm=True), hf_config)

    def make_mlp(self, layer_idx: int) -> nn.Module | None:
        cfg = self.config
        if not cfg.sparse_layers[layer_idx]:
            return None
        return SparseMoeBlock(
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.norm_topk_prob,
        )
