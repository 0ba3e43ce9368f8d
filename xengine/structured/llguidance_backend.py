"""The llguidance backend (https://github.com/guidance-ai/llguidance): Earley parser + lazy lexer in Rust.

Compiling builds a template ``LLMatcher`` and computes its first mask (which warms the lexer state
its copies share); every sequence then gets a cheap ``template.deep_copy()``. llguidance reports
grammar errors through the matcher, never by raising; they become ``ValueError`` here.
"""

from __future__ import annotations

from pathlib import Path

import llguidance as llg
import torch

from xengine.api.grammar import (
    GrammarSpec,
    check_llguidance_grammar,
    llguidance_grammar,
    make_lltokenizer,
    short_error,
)
from xengine.structured.backend import BaseCompiledGrammar, BaseGrammarBackend, BaseGrammarMatcher
from xengine.structured.bitmask import allocate_bitmask


class LLGuidanceMatcher(BaseGrammarMatcher):
    def __init__(self, matcher: llg.LLMatcher, eos_token_ids: frozenset[int]) -> None:
        self._m = matcher
        self._eos = eos_token_ids

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        view = bitmask[row]
        self._m.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * view.element_size())

    def accept_token(self, token_id: int) -> bool:
        if self._m.is_stopped():  # complete: eos is what the mask allowed; nothing to consume
            return token_id in self._eos and not self._m.is_error()
        return self._m.consume_token(token_id)

    def is_terminated(self) -> bool:
        return self._m.is_stopped()

    def valid_prefix(self, token_ids: list[int]) -> int:
        if not token_ids or self._m.is_stopped() or self._m.is_error():
            return 0
        return self._m.validate_tokens(token_ids)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)


class LLGuidanceGrammar(BaseCompiledGrammar):
    def __init__(self, template: llg.LLMatcher, eos_token_ids: frozenset[int], num_ids: int) -> None:
        self._template = template  # never advanced: only copied
        self._eos = eos_token_ids
        self.num_ids = num_ids

    def new_matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._template.deep_copy(), self._eos)


class LLGuidanceBackend(BaseGrammarBackend):
    name = "llguidance"

    def __init__(self, tokenizer_file: Path, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer = make_lltokenizer(tokenizer_file, vocab_size, eos_token_ids)
        self.num_ids = self.tokenizer.vocab_size  # the tokenizer's ids and the model's, whichever is more
        self.eos_token_ids = frozenset(eos_token_ids)

    def compile(self, spec: GrammarSpec) -> LLGuidanceGrammar:
        grammar = llguidance_grammar(spec)
        check_llguidance_grammar(grammar, self.tokenizer)
        template = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ValueError(short_error(template.get_error()))
        scratch = allocate_bitmask(1, self.num_ids)
        LLGuidanceMatcher(template, self.eos_token_ids).fill_bitmask(scratch, 0)  # warms the lexer
        if template.is_error():
            raise ValueError(short_error(template.get_error()))
        return LLGuidanceGrammar(template, self.eos_token_ids, self.num_ids)
