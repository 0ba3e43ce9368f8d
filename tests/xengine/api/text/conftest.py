"""Fixtures of the text-layer tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from xengine.api.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_qwen3) -> Tokenizer:
    return Tokenizer.from_dir(tiny_qwen3)


def byte_symbol(b: int) -> str:
    """The GPT-2 byte-to-unicode symbol of byte ``b`` (the ByteLevel alphabet)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    if b in printable:
        return chr(b)
    return chr(256 + sorted(set(range(256)) - set(printable)).index(b))


@pytest.fixture(scope="module")
def byte_token_ids(tok: Tokenizer) -> Callable[[bytes], list[int]]:
    """``data -> ids``: one single-byte token per byte (splits multi-byte characters)."""
    return lambda data: [tok.token_to_id(byte_symbol(b)) for b in data]
