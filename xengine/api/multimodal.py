"""Images of a request as they cross into the engine (torch-free msgspec structs).

The caller (the service, or ``LLM`` offline) decodes and preprocesses each image
(``xengine/api/image_processing.py``) and expands its one-token placeholder in the prompt to as many
image-pad tokens as the vision encoder yields embeddings; the engine loop then only runs the encoder
and never touches image files. ``content_hash`` names the preprocessed pixels: the engine's
image-embedding cache and its prefix cache key on it, so a repeated image is encoded once and its KV
blocks are shared, while two different images behind the same pad tokens never are.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

# dtypes ``pixel_values`` may come in (the preprocessor writes float32)
PIXEL_DTYPES = ("float32", "float16", "bfloat16")


class ImageInput(msgspec.Struct, kw_only=True, frozen=True):
    """One preprocessed image and the prompt tokens it fills."""

    content_hash: str  # sha256 hex of the preprocessed pixels (``pixel_hash``)
    pixel_values: bytes  # row-major [num_patches, patch_dim] array of ``dtype``
    shape: tuple[int, int]  # (num_patches, channels * temporal_patch * patch * patch)
    dtype: str = "float32"
    grid_thw: tuple[int, int, int]  # patches along time, height, width (before the spatial merge)
    offset: int  # index of its first image-pad token in the prompt
    length: int  # its image-pad tokens: t * h * w / merge_size**2


def pixel_hash(pixel_values: bytes, shape: Sequence[int], dtype: str, grid_thw: Sequence[int]) -> str:
    """sha256 hex of the preprocessed pixels with their shape, dtype and grid (what the encoder sees)."""
    h = hashlib.sha256()
    h.update(repr((tuple(shape), dtype, tuple(grid_thw))).encode())
    h.update(pixel_values)
    return h.hexdigest()


def num_image_tokens(grid_thw: Sequence[int], merge_size: int) -> int:
    """Image-pad tokens (= encoder output rows) of an image of ``grid_thw`` patches."""
    t, h, w = grid_thw
    return t * h * w // (merge_size * merge_size)


def expand_image_placeholders(
    token_ids: list[int], num_tokens: Sequence[int], image_token_id: int
) -> tuple[list[int], list[tuple[int, int]]]:
    """Replace the i-th ``image_token_id`` of ``token_ids`` by ``num_tokens[i]`` copies of it.

    Returns the expanded ids and each image's ``(offset, length)`` in them. ``ValueError`` when the
    prompt holds another number of image placeholders than there are images (e.g. a chat template
    that does not render image parts, or a text that spells the placeholder itself)."""
    positions = [i for i, t in enumerate(token_ids) if t == image_token_id]
    if len(positions) != len(num_tokens):
        raise ValueError(
            f"the prompt has {len(positions)} image placeholder(s) for {len(num_tokens)} image(s); the chat "
            "template must render one placeholder per image part, and text must not contain it"
        )
    out: list[int] = []
    spans: list[tuple[int, int]] = []
    prev = 0
    for pos, n in zip(positions, num_tokens):
        out.extend(token_ids[prev:pos])
        spans.append((len(out), n))
        out.extend([image_token_id] * n)
        prev = pos + 1
    out.extend(token_ids[prev:])
    return out, spans
