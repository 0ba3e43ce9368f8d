"""How the prefix cache keys a prompt with images, computable without the engine (torch-free).

A LoRA request's first position is keyed by its adapter (``lora_cache_key``): each adapter has a
prefix cache of its own. Each image's pad tokens are keyed by a negative 62-bit integer derived from the image's content
hash (never a token id), so blocks of two different images never match while a repeated image does.
The engine keys its radix cache this way (``xengine/multimodal/request_images.py``; a test pins the
two together); the service uses it to name a prompt's KV blocks in PD's export / import.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from xengine.api.multimodal import ImageInput


def image_cache_key(content_hash: str) -> int:
    """The prefix-cache key standing for every pad token of an image: a negative 62-bit integer."""
    digest = hashlib.blake2b(content_hash.encode(), digest_size=8).digest()
    return -1 - (int.from_bytes(digest, "little") >> 2)


def lora_cache_key(lora_name: str, first_key: int) -> int:
    """The key of a LoRA request's first prompt position: the adapter and that position's own key
    hashed into an integer below every image key (``< -2**62``), so no block of one adapter (or of the
    base model) is found for another while prompts of one adapter share their prefixes."""
    digest = hashlib.blake2b(f"{lora_name}\0{first_key}".encode(), digest_size=8).digest()
    return -(2**62) - 1 - (int.from_bytes(digest, "little") >> 3)


def cache_token_ids(
    prompt_token_ids: Sequence[int], images: Sequence[ImageInput] | None, lora_name: str | None = None
) -> list[int]:
    """The prompt as the prefix cache keys it (the prompt itself when it has no images and no adapter)."""
    keyed = list(prompt_token_ids)
    for im in images or ():
        keyed[im.offset : im.offset + im.length] = [image_cache_key(im.content_hash)] * im.length
    if lora_name is not None and keyed:
        keyed[0] = lora_cache_key(lora_name, keyed[0])
    return keyed


def images_end(images: Sequence[ImageInput] | None) -> int:
    """Index after the last image pad of the prompt (0: no images)."""
    return max((im.offset + im.length for im in images or ()), default=0)
