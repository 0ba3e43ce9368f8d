"""How the prefix cache keys a prompt with images, computable without the engine (torch-free).

A request's first position is keyed by its LoRA adapter and its ``cache_salt`` (``salted_key``): each
adapter and each salt has a prefix cache of its own. Each image's pad tokens are keyed by a negative 62-bit integer derived from the image's content
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


def salted_key(first_key: int, lora_name: str | None, cache_salt: str | None) -> int:
    """The key of the first prompt position of a request with a LoRA adapter or a ``cache_salt``: both
    and that position's own key hashed into an integer below every image key (``< -2**62``), so no
    block of one adapter (or salt, or of the base model unsalted) is found for another, while prompts
    of the same adapter and salt share their prefixes."""
    text = f"{lora_name!r}\0{cache_salt!r}\0{first_key}"
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return -(2**62) - 1 - (int.from_bytes(digest, "little") >> 3)


def cache_token_ids(
    prompt_token_ids: Sequence[int],
    images: Sequence[ImageInput] | None,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[int]:
    """The prompt as the prefix cache keys it (the prompt itself without images, adapter or salt)."""
    keyed = list(prompt_token_ids)
    for im in images or ():
        keyed[im.offset : im.offset + im.length] = [image_cache_key(im.content_hash)] * im.length
    if (lora_name is not None or cache_salt is not None) and keyed:
        keyed[0] = salted_key(keyed[0], lora_name, cache_salt)
    return keyed


def images_end(images: Sequence[ImageInput] | None) -> int:
    """Index after the last image pad of the prompt (0: no images)."""
    return max((im.offset + im.length for im in images or ()), default=0)
