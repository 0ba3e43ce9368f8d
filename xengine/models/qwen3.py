"""Qwen3 (dense): the generic decoder with per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

from typing import Any

from xengine.models.decoder import DecoderForCausalLM
from xengine.models.decoder_config import DecoderConfig, decoder_config_from_hf


class Qwen3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def config_from_hf(cls, hf_config: dict[str, Any]) -> DecoderConfig:
        return decoder_config_from_hf(hf_config, qk_norm=True)
