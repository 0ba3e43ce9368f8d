"""A sound character bound on token counts: ``len(text) > n * max_token_chars`` means more than ``n`` tokens.

It holds when every character of the input ends up inside some token and no token covers more than
``max_token_chars`` characters of the input. That is true for BPE pipelines that never drop or
merge away characters (byte-level BPE with its full byte alphabet, SentencePiece-style BPE with
byte fallback or an unfused unknown token) and is not for others (a pre-tokenizer that drops
whitespace, a fused unknown token that swallows any run of unknown characters, a normalizer that
shrinks text, added tokens that strip neighbouring whitespace, truncation). For those no bound is
given (None) and only the real token count decides.
"""

from __future__ import annotations

import json
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.pre_tokenizers import ByteLevel

# Normalizers whose output is never shorter than their input.
_GROWING_NORMALIZERS = {"Lowercase", "NFD", "NFKD", "Prepend", "ByteLevel"}
# Pre-tokenizers that keep every character (they only split, or map one byte to one symbol).
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}


def _normalizer_keeps_length(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_normalizer_keeps_length(s) for s in spec.get("normalizers") or [])
    if kind == "Replace":  # a plain string replaced by one at least as long
        pattern = (spec.get("pattern") or {}).get("String")
        return isinstance(pattern, str) and len(spec.get("content") or "") >= len(pattern)
    return kind in _GROWING_NORMALIZERS


def _pre_tokenizer_keeps_chars(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_chars(s) for s in spec.get("pretokenizers") or [])
    if kind in ("Split", "Punctuation"):
        return spec.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _is_byte_level(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return False
    if spec.get("type") == "Sequence":
        return any(_is_byte_level(s) for s in spec.get("pretokenizers") or [])
    return spec.get("type") == "ByteLevel"


def _covers_every_char(spec: dict[str, Any], vocab: dict[str, int]) -> bool:
    """Whether the BPE model turns any character into tokens (never drops or fuses unknown ones)."""
    model = spec["model"]
    if model.get("unk_token") is not None and not model.get("fuse_unk"):
        return True  # an unknown character becomes one unknown token
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return False  # symbols are looked up with affixes: the bare alphabet proves nothing
    if _is_byte_level(spec.get("pre_tokenizer")) or (spec.get("normalizer") or {}).get("type") == "ByteLevel":
        return all(symbol in vocab for symbol in ByteLevel.alphabet())
    return bool(model.get("byte_fallback")) and all(f"<0x{b:02X}>" in vocab for b in range(256))


def max_token_chars(backend: HFTokenizer) -> int | None:
    """The most input characters one token of ``backend`` can cover, or None when no sound bound exists.

    Byte-level vocabularies spell tokens in one symbol per byte, and a character is at least one
    byte, so a token's length in symbols bounds the characters it covers.
    """
    spec = json.loads(backend.to_str())
    if (spec.get("model") or {}).get("type") != "BPE" or spec.get("truncation") is not None:
        return None
    if not _normalizer_keeps_length(spec.get("normalizer")):
        return None
    if not _pre_tokenizer_keeps_chars(spec.get("pre_tokenizer")):
        return None
    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None  # such a token also swallows the whitespace around it, however long
    vocab = backend.get_vocab(with_added_tokens=True)
    if not vocab or not _covers_every_char(spec, vocab):
        return None
    longest = max(len(token) for token in vocab)
    normalizer = backend.normalizer
    if normalizer is not None:  # added tokens matched after normalization cover their normalized form
        lengths = (len(normalizer.normalize_str(t["content"])) for t in added if t.get("normalized"))
        longest = max(longest, *lengths, 0)
    return longest
