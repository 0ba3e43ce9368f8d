"""Qwen2 / Qwen2.5: the generic decoder with biases on q/k/v (not on o_proj)."""

from __future__ import annotations

from typing import Any

from xengine.models.decoder import DecoderForCausalLM
from xengine.models.decoder_config import DecoderConfig, decoder_config_from_hf


class Qwen2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def config_from_hf(cls, hf_config: dict[str, Any]) -> DecoderConfig:
        return decoder_config_from_hf(hf_config, qkv_bias=True, o_bias=False)
