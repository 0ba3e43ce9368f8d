"""Checks of the token-level constraint fields of ``SamplingParams`` (torch-free, shared by every entry point).

Each check raises ``ValueError("invalid value for '<field>': ...")`` so the service turns it into a 400
naming the field. These are the cheap, tokenizer-independent checks; whether a schema, regex or
grammar compiles is decided by the grammar backend (``xengine/structured/``), off the engine loop.
"""

from __future__ import annotations

import math
from typing import Any

from xengine.api.grammar_bounds import SpecTooComplexError, parse_json_bounded

MAX_LOGIT_BIAS_ENTRIES = 1024
LOGIT_BIAS_RANGE = 100.0  # OpenAI's bound: values in [-100, 100]
MAX_BAD_WORDS = 256  # token sequences (the service sends each word with and without a leading space)
MAX_BAD_WORD_TOKENS = 64
MAX_GRAMMAR_CHARS = 1 << 20  # a schema, regex or grammar
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 4096

STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


def _fail(field: str, rule: str) -> None:
    raise ValueError(f"invalid value for '{field}': {rule}")


def _is_token_id(t: Any, vocab_size: int | None) -> bool:
    return type(t) is int and t >= 0 and (vocab_size is None or t < vocab_size)


def check_structured_outputs(so: Any) -> None:
    """``so``: a ``StructuredOutputsParams``. Exactly one constraint, of a sane size."""
    field = "structured_outputs"
    given = [k for k in STRUCTURED_KINDS if getattr(so, k) not in (None, False)]
    if len(given) != 1:
        _fail(field, f"set exactly one of {', '.join(STRUCTURED_KINDS)} (got {given or 'none'})")
    kind = given[0]
    _check_json_options(so, kind)
    resume = so.resume_token_ids
    if resume is not None and (
        not isinstance(resume, list) or not all(_is_token_id(t, None) for t in resume)
    ):
        _fail(field, "'resume_token_ids' must be a list of token ids")
    pattern = so.whitespace_pattern
    if pattern is not None and (not isinstance(pattern, str) or not 0 < len(pattern) <= MAX_CHOICE_CHARS):
        _fail(field, f"'whitespace_pattern' must be a regex of 1..{MAX_CHOICE_CHARS} characters")
    if kind == "structural_tag":
        _fail(field, "structural tags are not supported; use 'json', 'regex', 'choice' or 'grammar'")
    if kind == "choice":
        choice = so.choice
        if not isinstance(choice, list) or not 1 <= len(choice) <= MAX_CHOICES:
            _fail(field, f"'choice' must be a list of 1..{MAX_CHOICES} strings")
        for c in choice:
            if not isinstance(c, str) or not 0 < len(c) <= MAX_CHOICE_CHARS:
                _fail(field, f"each choice must be a string of 1..{MAX_CHOICE_CHARS} characters")
        return
    if kind == "json_object":
        return
    text = getattr(so, kind)
    if not isinstance(text, str) or not 0 < len(text) <= MAX_GRAMMAR_CHARS:
        _fail(field, f"'{kind}' must be a non-empty string of at most {MAX_GRAMMAR_CHARS} characters")
    if kind == "json":
        try:
            schema = parse_json_bounded(text)
        except SpecTooComplexError as e:
            _fail(field, str(e))
        except ValueError as e:
            _fail(field, f"the JSON schema is not valid JSON: {e}")
        if not isinstance(schema, (dict, bool)):
            _fail(field, "a JSON schema must be an object (or a boolean)")


def _check_json_options(so: Any, kind: str) -> None:
    """JSON-only options on another kind of constraint would have no effect: refuse them."""
    if kind in ("json", "json_object"):
        return
    for option in ("whitespace_pattern", "disable_any_whitespace", "disable_additional_properties"):
        if getattr(so, option) not in (None, False):
            _fail("structured_outputs", f"'{option}' applies only to 'json' / 'json_object', not '{kind}'")


def check_logit_bias(bias: Any, vocab_size: int | None) -> None:
    field = "logit_bias"
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        _fail(field, f"must map at most {MAX_LOGIT_BIAS_ENTRIES} token ids to biases")
    for token, value in bias.items():
        if not _is_token_id(token, vocab_size):
            _fail(field, f"token id {token!r} is not in the vocabulary [0, {vocab_size})")
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or abs(value) > LOGIT_BIAS_RANGE:
            _fail(field, f"bias of token {token} must be a number in [-100, 100], got {value!r}")


def check_allowed_token_ids(ids: Any, vocab_size: int | None) -> None:
    field = "allowed_token_ids"
    if not isinstance(ids, list) or not ids:
        _fail(field, "must be a non-empty list of token ids")
    if vocab_size is not None and len(ids) > vocab_size:
        _fail(field, f"at most {vocab_size} ids")
    bad = next((t for t in ids if not _is_token_id(t, vocab_size)), None)
    if bad is not None:
        _fail(field, f"token id {bad!r} is not in the vocabulary [0, {vocab_size})")


def check_bad_words(words: Any, vocab_size: int | None) -> None:
    field = "bad_words_token_ids"
    if not isinstance(words, list) or len(words) > MAX_BAD_WORDS:
        _fail(field, f"at most {MAX_BAD_WORDS} token sequences")
    for seq in words:
        if not isinstance(seq, list) or not 0 < len(seq) <= MAX_BAD_WORD_TOKENS:
            _fail(field, f"each banned sequence must have 1..{MAX_BAD_WORD_TOKENS} tokens")
        bad = next((t for t in seq if not _is_token_id(t, vocab_size)), None)
        if bad is not None:
            _fail(field, f"token id {bad!r} is not in the vocabulary [0, {vocab_size})")


def check_constraints(params: Any, vocab_size: int | None) -> None:
    """Every constraint field of a ``SamplingParams`` that is set; beam search takes none of them."""
    names = ("structured_outputs", "logit_bias", "allowed_token_ids", "bad_words_token_ids")
    used = [n for n in names if getattr(params, n) is not None]
    if not used:
        return
    if params.use_beam_search:
        _fail(used[0], "not supported with beam search")
    if params.structured_outputs is not None:
        check_structured_outputs(params.structured_outputs)
        resume = params.structured_outputs.resume_token_ids or []
        bad = next((t for t in resume if not _is_token_id(t, vocab_size)), None)
        if bad is not None:
            _fail(
                "structured_outputs", f"resumed token id {bad!r} is not in the vocabulary [0, {vocab_size})"
            )
    if params.logit_bias is not None:
        check_logit_bias(params.logit_bias, vocab_size)
    if params.allowed_token_ids is not None:
        check_allowed_token_ids(params.allowed_token_ids, vocab_size)
    if params.bad_words_token_ids is not None:
        check_bad_words(params.bad_words_token_ids, vocab_size)
