"""The grammar-backend contract: compile a ``GrammarSpec`` for this model's vocabulary, then one matcher
per sequence that fills token bitmasks and accepts sampled tokens.

One backend is implemented, llguidance (``llguidance_backend.py``), chosen by measurement on this CPU
(``benchmarks/structured_backends.py``; numbers in ``docs/structured_outputs.md``): its cold compile
stays in milliseconds where xgrammar's takes up to seconds on a 151k vocabulary, its per-step mask
avoids xgrammar's multi-millisecond worst case (inside length-bounded strings), and it needs no
torch / triton of its own. xgrammar (or another) would be one more subclass triple registered in
``factory.create_backend``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from xengine.api.grammar import GrammarSpec


class BaseGrammarMatcher(ABC):
    """The parse state of one sequence. Used by one thread at a time (the one running the step)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the ids allowed next into row ``row`` of a CPU int32 bitmask (``bitmask.py``); once
        the grammar is complete, or the matcher failed, only the eos ids are allowed."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance past ``token_id``; False (and the matcher stays failed) if the grammar rejects it.
        Never raises."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once nothing but eos can follow."""

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of ``token_ids`` (speculative decoding's drafts) the grammar accepts in a row from
        the current state, without advancing. A backend that cannot tell answers 0: no drafts."""
        return 0

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (drafts advanced through to fill their masks)."""
        raise NotImplementedError(f"{type(self).__name__} cannot roll back")


class BaseCompiledGrammar(ABC):
    """A grammar compiled for one vocabulary; immutable, shared by every sequence that uses it."""

    num_ids: int  # ids its bitmasks cover (>= the model's logits width): ceil(num_ids / 32) words a row

    @abstractmethod
    def new_matcher(self) -> BaseGrammarMatcher:
        """A matcher at the start of the grammar (cheap: a copy of a warmed template)."""


class BaseGrammarBackend(ABC):
    """Compiles specs for one tokenizer. ``compile`` may be called from a worker thread."""

    name: str

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> BaseCompiledGrammar:
        """Raises ``ValueError`` (why the schema / regex / grammar is invalid or unsupported)."""
