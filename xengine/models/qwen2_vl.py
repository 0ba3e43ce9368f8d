"""Qwen2-VL and Qwen2.5-VL: a vision tower in front of the Qwen2 decoder, with M-RoPE positions.

The language model is our dense decoder (``decoder.py``) with its rotary swapped for M-RoPE, so
text-only steps (one position id per token) run exactly the text path, graphs included;
``forward_multimodal`` is the eager path of steps whose tokens include image pads: their input
embeddings are replaced by the vision tower's outputs and positions are ``[3, T]``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from xengine.layers.linear import make_weights_input_major
from xengine.models.decoder import DecoderForCausalLM
from xengine.models.decoder_config import DecoderConfig, decoder_config_from_hf
from xengine.models.info import text_config
from xengine.models.mrope import MRotaryEmbedding
from xengine.models.qwen2_vl_vision import VisionConfig, VisionTransformer
from xengine.models.weights import WeightLoader

# transformers >= 4.52 nests the parts under ``model.``; ours (and transformers 5's save) do not
_RENAMES = (("model.language_model.", "model."), ("model.visual.", "visual."))


class Qwen2VLForConditionalGeneration(DecoderForCausalLM):
    # tensor parallel: the language model splits, the vision tower is replicated (image requests are
    # refused on a parallel instance: its workers would not receive the image embeddings)
    tensor_parallel = True
    windowed_vision = False  # Qwen2.5-VL: window attention in the vision tower

    def __init__(self, cfg: DecoderConfig, hf_config: dict[str, Any]) -> None:
        super().__init__(cfg)
        text = text_config(hf_config)
        section = (text.get("rope_parameters") or text.get("rope_scaling") or {}).get("mrope_section")
        if not section:
            raise ValueError("config.json lacks rope_parameters.mrope_section (M-RoPE) for a Qwen2-VL model")
        rotary = MRotaryEmbedding(
            cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta, section, cfg.rope_scaling
        )
        self.model.rotary = rotary
        for layer in self.model.layers:
            layer.self_attn.rotary = rotary
        self.visual = VisionTransformer(
            VisionConfig.from_hf(hf_config["vision_config"], self.windowed_vision, cfg.hidden_size)
        )
        self.image_token_id = int(hf_config["image_token_id"])
        self.merge_size = self.visual.config.merge_size

    @classmethod
    def config_from_hf(cls, hf_config: dict[str, Any]) -> DecoderConfig:
        return decoder_config_from_hf(text_config(hf_config), qkv_bias=True, o_bias=False)

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> Qwen2VLForConditionalGeneration:
        return cls(cls.config_from_hf(hf_config), hf_config)

    def encode_images(self, patches: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """Image embeddings ``[sum(t * h * w) / merge**2, hidden]`` of ``patches`` (images in order)."""
        return self.visual(patches, grids).to(self.model.embed_tokens.weight.dtype)

    def forward_multimodal(
        self, input_ids: torch.Tensor, positions: torch.Tensor, embeds: torch.Tensor, at: torch.Tensor
    ) -> torch.Tensor:
        """Hidden states of a step whose tokens ``at`` ([N]) take ``embeds`` ([N, hidden]) instead of their
        token embeddings; ``positions``: ``[3, T]`` M-RoPE ids. The forward context must be set."""
        hidden = self.model.embed_tokens(input_ids)
        hidden = hidden.index_copy(0, at, embeds.to(hidden.dtype))
        return self.model.forward_layers(positions, hidden, None)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.tie_weights()
        make_weights_input_major(self, keep=(self.model.embed_tokens.weight,))
        skip = ("lm_head.weight",) if self.config.tie_word_embeddings else ()
        WeightLoader(self, skip=skip).load((_rename(name), tensor) for name, tensor in weights)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    windowed_vision = True


def _rename(name: str) -> str:
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name
