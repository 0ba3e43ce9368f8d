"""Chat messages with image parts -> prompt token ids + preprocessed ``ImageInput``s (torch-free).

What both the offline ``LLM.chat`` and the service do before a multimodal request reaches an engine:
load each ``image_url`` part (``media.py``), preprocess it (``image_processing.py``), render the chat
template (one placeholder per image part), tokenize, and expand each placeholder to the image's
number of embedding tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from xengine.api.image_processing import ImageProcessor
from xengine.api.media import MediaLimits, load_image
from xengine.api.multimodal import ImageInput, expand_image_placeholders
from xengine.api.text.tokenizer import Tokenizer

IMAGE_PART_TYPES = ("image_url",)


def image_parts(messages: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The image parts of ``messages``, in prompt order."""
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                    yield part


def image_part_url(part: dict[str, Any]) -> str:
    """``part["image_url"]["url"]`` (or a bare string ``image_url``); ``ValueError`` when absent."""
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(url, str) or not url:
        raise ValueError(
            "an image_url content part needs image_url.url (a data: URL or an allowed local file)"
        )
    return url


@dataclass
class ChatPrompt:
    text: str
    token_ids: list[int]
    images: list[ImageInput]


class ChatImageBuilder:
    """Builds multimodal chat prompts for one vision-language model folder."""

    def __init__(
        self,
        processor: ImageProcessor,
        image_token_id: int,
        allowed_local_media_path: str | Path | None = None,
        limits: MediaLimits | None = None,
    ) -> None:
        self.processor = processor
        self.image_token_id = image_token_id
        self.allowed_local_media_path = allowed_local_media_path
        self.limits = limits or MediaLimits()

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        allowed_local_media_path: str | Path | None = None,
        limits: MediaLimits | None = None,
    ) -> ChatImageBuilder | None:
        """None for a model without an image processor or an ``image_token_id`` (text only)."""
        import json

        processor = ImageProcessor.from_dir(model_dir)
        config_path = Path(model_dir) / "config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        token_id = config.get("image_token_id")
        if processor is None or not isinstance(token_id, int):
            return None
        return cls(processor, token_id, allowed_local_media_path, limits)

    def load_images(self, messages: list[dict[str, Any]]) -> list[ImageInput]:
        """Load and preprocess every image part (offsets still 0); ``ValueError`` naming the bad image."""
        parts = list(image_parts(messages))
        if len(parts) > self.limits.max_images_per_request:
            raise ValueError(
                f"{len(parts)} images, more than the limit of {self.limits.max_images_per_request}"
            )
        images = []
        for i, part in enumerate(parts):
            try:
                image = load_image(image_part_url(part), self.allowed_local_media_path, self.limits)
                images.append(self.processor.image_input(image))
            except ValueError as e:
                raise ValueError(f"image {i}: {e}") from e
        return images

    def build(
        self,
        tokenizer: Tokenizer,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **kw: Any,
    ) -> ChatPrompt:
        images = self.load_images(messages)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kw)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return ChatPrompt(text, *place_images(ids, images, self.image_token_id))


def place_images(
    token_ids: list[int], images: list[ImageInput], image_token_id: int
) -> tuple[list[int], list[ImageInput]]:
    """Expand each image's placeholder in ``token_ids``; the images with their ``offset`` set."""
    ids, spans = expand_image_placeholders(token_ids, [im.length for im in images], image_token_id)
    return ids, [msgspec.structs.replace(im, offset=offset) for im, (offset, _) in zip(images, spans)]
