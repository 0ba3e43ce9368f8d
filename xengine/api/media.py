"""Load an image part's URL into a PIL image, safely (torch-free: the service calls it too).

Only ``data:image/...;base64,`` URLs, and local files under one allow-listed folder (a ``file://``
URL or a plain path) when the caller configured it; nothing is fetched from the network. Limits on
encoded bytes and decoded pixels are checked before the pixels are decoded (Pillow reads the size
from the header), so a small file that claims a huge image is refused without decoding it.
Every refusal is a ``ValueError`` whose message says what was wrong.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

# what Pillow may decode for us; anything else (e.g. a PDF or an SVG) is refused
ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


@dataclass(frozen=True)
class MediaLimits:
    """Bounds on one image and on a request's images."""

    max_image_bytes: int = 20 * 1024 * 1024  # encoded size
    max_image_pixels: int = 40_000_000  # decoded width * height (Pillow's bomb limit is ~89M)
    max_images_per_request: int = 16


def load_image(
    url: str, allowed_local_media_path: str | Path | None = None, limits: MediaLimits | None = None
) -> Any:
    """The decoded RGB-convertible PIL image of ``url``; ``ValueError`` naming the problem."""
    limits = limits or MediaLimits()
    if not isinstance(url, str) or not url:
        raise ValueError("image_url.url must be a non-empty string")
    if url.startswith("data:"):
        data = _data_url_bytes(url, limits)
    else:
        data = _local_file_bytes(url, allowed_local_media_path, limits)
    return decode_image(data, limits)


def _data_url_bytes(url: str, limits: MediaLimits) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise ValueError("image data URL has no ',' before its data")
    media_type, _, params = header[len("data:") :].partition(";")
    if not media_type.lower().startswith("image/"):
        raise ValueError(
            f"unsupported image data URL media type {media_type or '(none)'!r}; expected image/*"
        )
    if "base64" not in params.split(";"):
        raise ValueError("image data URLs must be base64-encoded (data:image/png;base64,...)")
    if len(payload) > limits.max_image_bytes * 4 // 3 + 4:
        raise ValueError(f"image is larger than {limits.max_image_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"image data URL is not valid base64: {e}") from e


def _local_file_bytes(url: str, allowed: str | Path | None, limits: MediaLimits) -> bytes:
    parsed = urlparse(url)
    if parsed.scheme not in ("", "file"):
        raise ValueError(
            f"unsupported image URL scheme {parsed.scheme!r}: only data: URLs (and local files under the "
            "allowed media folder) are accepted; nothing is fetched from the network"
        )
    if allowed is None:
        raise ValueError("local image files are not allowed (no allowed_local_media_path is configured)")
    path = Path(unquote(parsed.path) if parsed.scheme == "file" else url)
    root = Path(allowed).resolve()
    resolved = path.resolve()
    if root != resolved and root not in resolved.parents:
        raise ValueError(f"image file {str(path)!r} is outside the allowed media folder")
    if not resolved.is_file():
        raise ValueError(f"image file {str(path)!r} does not exist")
    if os.path.getsize(resolved) > limits.max_image_bytes:
        raise ValueError(f"image is larger than {limits.max_image_bytes} bytes")
    return resolved.read_bytes()


def decode_image(data: bytes, limits: MediaLimits | None = None) -> Any:
    """Decode encoded image bytes with Pillow after checking format and pixel count."""
    from PIL import Image, UnidentifiedImageError

    limits = limits or MediaLimits()
    if len(data) > limits.max_image_bytes:
        raise ValueError(f"image is larger than {limits.max_image_bytes} bytes")
    try:
        image = Image.open(io.BytesIO(data), formats=list(ALLOWED_FORMATS))
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(
            f"cannot decode the image: not a valid image of a supported format ({', '.join(ALLOWED_FORMATS)})"
        ) from e
    except Image.DecompressionBombError as e:
        raise ValueError(f"image has more pixels than the limit of {limits.max_image_pixels}") from e
    width, height = image.size
    if width < 1 or height < 1:
        raise ValueError(f"image has no pixels ({width}x{height})")
    if width * height > limits.max_image_pixels:
        raise ValueError(
            f"image has {width}x{height} pixels, more than the limit of {limits.max_image_pixels}"
        )
    try:
        image.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"cannot decode the image: {e}") from e
    return image
