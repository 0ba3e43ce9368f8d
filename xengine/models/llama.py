"""Llama and Mistral: the generic decoder with the config's own ``attention_bias`` / ``mlp_bias``."""

from __future__ import annotations

from xengine.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama 2/3/3.x (rope scaling: linear, dynamic, llama3, yarn)."""


class MistralForCausalLM(DecoderForCausalLM):
    """Mistral: Llama plus an optional sliding window on every layer (parsed from ``sliding_window``)."""
