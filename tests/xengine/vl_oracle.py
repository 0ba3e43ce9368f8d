"""HF oracle and inputs for the vision-language tests (Qwen2-VL / Qwen2.5-VL tiny checkpoints).

The oracle is HF ``transformers`` in float32: its PIL image processor (``AutoProcessor`` would also
build the video processor, which needs torchvision), the tokenizer's chat template, the processor's
placeholder expansion (each ``<|image_pad|>`` repeated ``t * h * w / merge**2`` times) and
``generate(do_sample=False)`` with ``pixel_values``, ``image_grid_thw`` and ``mm_token_type_ids``.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import numpy as np
import torch

VL_ARCHS = ("qwen2_vl", "qwen2_5_vl")


def random_image(height: int, width: int, seed: int, mode: str = "RGB") -> Any:
    from PIL import Image

    channels = len(mode)
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode)


def data_url(image: Any, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def user_turn(*parts: Any) -> dict[str, Any]:
    """A user message from text strings and PIL images (as OpenAI ``image_url`` data-URL parts)."""
    content = [
        {"type": "text", "text": p}
        if isinstance(p, str)
        else {"type": "image_url", "image_url": {"url": data_url(p)}}
        for p in parts
    ]
    return {"role": "user", "content": content}


class VLOracle:
    """HF greedy generation on one vision-language checkpoint."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import (
            AutoConfig,
            AutoTokenizer,
            Qwen2_5_VLForConditionalGeneration,
            Qwen2VLForConditionalGeneration,
        )
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        config = AutoConfig.from_pretrained(model_dir)
        cls = (
            Qwen2VLForConditionalGeneration
            if config.model_type == "qwen2_vl"
            else Qwen2_5_VLForConditionalGeneration
        )
        self.model = cls.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.processor = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.image_token_id = config.image_token_id

    def prompt(
        self, messages: list[dict[str, Any]], images: list[Any]
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """HF's input ids and image inputs of ``messages`` (image parts as ``{"type": "image"}``)."""
        hf_messages = [
            {**m, "content": [p if p["type"] == "text" else {"type": "image"} for p in m["content"]]}
            if isinstance(m["content"], list)
            else m
            for m in messages
        ]
        text = self.tokenizer.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
        if not images:
            return self.tokenizer(text, return_tensors="pt")["input_ids"], {}
        pixels = self.processor(images=images, return_tensors="pt")
        grids = pixels["image_grid_thw"]
        merge = self.processor.merge_size**2
        pieces = text.split("<|image_pad|>")
        text = pieces[0] + "".join(
            "<|image_pad|>" * int(g.prod() // merge) + p for g, p in zip(grids, pieces[1:])
        )
        ids = self.tokenizer(text, return_tensors="pt")["input_ids"]
        mm = (ids == self.image_token_id).int()
        return ids, dict(pixel_values=pixels["pixel_values"], image_grid_thw=grids, mm_token_type_ids=mm)

    @torch.no_grad()
    def greedy(self, messages: list[dict[str, Any]], images: list[Any], max_new_tokens: int) -> list[int]:
        ids, extra = self.prompt(messages, images)
        gen = self.model.generation_config
        saved, gen.eos_token_id = gen.eos_token_id, None  # ignore_eos
        try:
            out = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                **extra,
            )
        finally:
            gen.eos_token_id = saved
        return out[0, ids.shape[1] :].tolist()
