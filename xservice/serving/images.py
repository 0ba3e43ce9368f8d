"""Image parts of chat messages -> preprocessed ``ImageInput``s that ride on the ``AddRequest``.

The service does all the CPU work on images (decode, check the limits, resize, normalise, patchify;
``xengine/api/media.py`` and ``image_processing.py``) on a worker thread, never on the event loop
and never in the engine's step loop. Every bad image is a 400 naming its part
(``messages.1.content.0.image_url``, or ``input.0.content.0.image_url`` on ``/v1/responses``);
nothing is fetched from the network.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from xengine.api.media import load_image
from xservice.http.errors import InvalidRequestError
from xservice.protocol import ContentPart

if TYPE_CHECKING:
    from xengine.api.chat_images import ChatImageBuilder
    from xengine.api.multimodal import ImageInput

logger = logging.getLogger(__name__)

# What the chat template sees for an image part: HF's convention (the pixels never reach the template).
TEMPLATE_IMAGE_PART = {"type": "image"}
# OpenAI's ``detail`` values served: both mean the model's own preprocessing ("low" is refused)
DETAILS = ("auto", "high")


@dataclass(frozen=True)
class ImageRef:
    """One image part of a request: where it is (for a 400) and its URL."""

    param: str  # e.g. "messages.1.content.0.image_url"
    url: str


def image_ref(part: ContentPart, param: str) -> ImageRef:
    """Check an ``image_url`` part's fields (400 naming the field) and return what loading needs."""
    ref = part.image_url
    if ref is None:
        raise InvalidRequestError(
            "An 'image_url' content part needs an 'image_url' object with a 'url'.", param=param
        )
    check_detail(ref.detail, f"{param}.detail")
    return ImageRef(param, ref.url)


def check_detail(detail: str | None, param: str) -> None:
    """400 naming ``param`` unless ``detail`` (an image part's OpenAI ``detail``) is served here."""
    if detail in (None, *DETAILS):
        return
    why = (
        "'low' is not supported: images are processed at their own resolution (within the model's "
        "max_pixels), as 'auto' and 'high' ask"
        if detail == "low"
        else f"must be one of {', '.join(map(repr, DETAILS))}, got {detail!r}"
    )
    raise InvalidRequestError(f"Invalid 'detail': {why}.", param=param)


async def load_images(builder: ChatImageBuilder, refs: list[ImageRef]) -> list[ImageInput]:
    """Load and preprocess ``refs`` in prompt order, off the event loop (offsets still 0)."""
    limit = builder.limits.max_images_per_request
    if len(refs) > limit:
        raise InvalidRequestError(
            f"The messages hold {len(refs)} images; at most {limit} are accepted per request "
            "(service.max_images_per_request).",
            param=refs[limit].param,
        )
    if not refs:
        return []
    return await asyncio.to_thread(_load_all, builder, refs)


def _load_all(builder: ChatImageBuilder, refs: list[ImageRef]) -> list[ImageInput]:
    images = []
    for ref in refs:
        try:
            image = load_image(ref.url, builder.allowed_local_media_path, builder.limits)
            images.append(builder.processor.image_input(image))
        except ValueError as exc:  # media.py's refusals say what was wrong
            raise InvalidRequestError(f"Invalid image: {exc}", param=ref.param) from None
        except Exception as exc:  # a decoder failing on crafted bytes is still the client's image
            logger.warning("image preprocessing failed (%s)", ref.param, exc_info=True)
            raise InvalidRequestError(
                f"Invalid image: cannot decode or preprocess it ({type(exc).__name__}).", param=ref.param
            ) from None
    return images
