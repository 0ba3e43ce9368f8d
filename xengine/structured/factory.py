"""``create_backend``: the grammar backend by name, its library imported only when chosen."""

from __future__ import annotations

from pathlib import Path

from xengine.structured.backend import BaseGrammarBackend

BACKENDS = ("llguidance",)


def create_backend(
    name: str, tokenizer_file: Path, vocab_size: int, eos_token_ids: list[int]
) -> BaseGrammarBackend:
    """The backend ``name`` for the tokenizer in ``tokenizer_file`` (a ``tokenizer.json``) and a model
    whose logits have ``vocab_size`` columns. Imports the backend's library only here."""
    if name == "llguidance":
        from xengine.structured.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(tokenizer_file, vocab_size, eos_token_ids)
    raise ValueError(f"unknown structured-output backend {name!r}; available: {', '.join(BACKENDS)}")
