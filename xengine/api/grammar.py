"""Grammars of structured outputs, tokenizer-free: what to compile and whether it is valid (torch-free).

``GrammarSpec`` is a ``StructuredOutputsParams`` normalised: the engine's compile-cache key. Two
requests whose constraints mean the same grammar get equal specs (a JSON schema is re-serialised
compactly; key order is kept: it is the order properties are generated in), so they share one
compiled grammar.

``check_spec`` runs the backend's own validator (llguidance's, without a tokenizer) so the service
can answer an invalid schema, regex or grammar with a 400 before anything is streamed; the engine's
compile (``xengine/structured/``) stays the authority. The validator is native code that a crafted
spec can crash, so ``check_spec`` first bounds the spec (``grammar_bounds``) and then runs it in a
sandbox process (``grammar_sandbox``), never in the caller's. llguidance is imported only when called.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xengine.api.grammar_bounds import parse_json_bounded
from xengine.api.grammar_spec import GrammarSpec
from xengine.api.messages import StructuredOutputsParams

if TYPE_CHECKING:
    import llguidance

# Flexible JSON whitespace (the default, as in vLLM) allows runs of at most this many characters
# between tokens: enough for pretty-printed JSON nested 30 deep, but a model can no longer loop on
# whitespace forever (small or badly prompted models do; xgrammar's ``max_whitespace_cnt`` is the
# same idea).
MAX_JSON_WHITESPACE = 64
FLEXIBLE_WHITESPACE = f"[\\x20\\x0A\\x0D\\x09]{{0,{MAX_JSON_WHITESPACE}}}"


def grammar_spec(so: StructuredOutputsParams) -> GrammarSpec:
    """The spec of ``so`` (already validated: exactly one constraint set)."""
    if so.choice is not None:
        return GrammarSpec("choice", json.dumps(so.choice, ensure_ascii=False))
    if so.regex is not None:
        return GrammarSpec("regex", so.regex)
    if so.grammar is not None:
        return GrammarSpec("grammar", so.grammar)
    schema: Any = {"type": "object"} if so.json_object else parse_json_bounded(so.json or "{}")
    if so.disable_additional_properties:
        schema = _close_objects(schema)
    if so.whitespace_pattern is not None:
        whitespace: str | None = so.whitespace_pattern
    else:
        whitespace = None if so.disable_any_whitespace else FLEXIBLE_WHITESPACE
    return GrammarSpec("json", json.dumps(schema, ensure_ascii=False, separators=(",", ":")), whitespace)


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def _close_objects(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` on every object schema that does not set it
    (vLLM's ``disable_additional_properties``); walks only the keywords that hold subschemas."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close_objects(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_close_objects(sub) for sub in out[key]]
    for key in _SCHEMA_ONE:
        if key in out:
            out[key] = (
                [_close_objects(s) for s in out[key]]
                if isinstance(out[key], list)
                else _close_objects(out[key])
            )
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


_MAX_ERROR_CHARS = 600  # llguidance appends its parser state to errors; the first lines say why


def llguidance_grammar(spec: GrammarSpec) -> str:
    """llguidance's grammar for ``spec`` (``ValueError`` when a GBNF grammar cannot be converted)."""
    import llguidance as llg

    m = llg.LLMatcher
    if spec.kind == "json":
        options: dict[str, object] = {"whitespace_flexible": False}
        if spec.whitespace is not None:
            options = {"whitespace_pattern": spec.whitespace}
        return m.grammar_from_json_schema(spec.source, defaults=options)
    if spec.kind == "regex":
        return m.grammar_from_regex(spec.source)
    if spec.kind == "choice":
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(spec.source))
        return m.grammar_from_lark(f"start: {alternatives}")
    return llg.grammar_from("grammar", spec.source)  # Lark, or GBNF converted to Lark


def check_llguidance_grammar(grammar: str, tokenizer: llguidance.LLTokenizer | None = None) -> None:
    """``ValueError`` with llguidance's reason when ``grammar`` is invalid (the tokenizer is optional)."""
    import llguidance as llg

    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise ValueError(short_error(messages[0] if messages else "invalid grammar"))


def check_spec(spec: GrammarSpec) -> None:
    """``ValueError`` saying why ``spec`` cannot compile, as far as that is tokenizer-independent.

    Runs in the shared tokenizer-free sandbox (blocking up to its timeout: call it off the event loop)."""
    from xengine.api.grammar_sandbox import shared_validator

    shared_validator().run(spec)


def make_lltokenizer(tokenizer_file: str | Path, vocab_size: int, eos_token_ids: list[int]) -> Any:
    """llguidance's tokenizer for ``tokenizer.json``; masks cover the tokenizer's ids and the model's
    ``vocab_size`` (either may be padded past the other)."""
    import llguidance as llg
    from tokenizers import Tokenizer

    num_ids = max(vocab_size, Tokenizer.from_file(str(tokenizer_file)).get_vocab_size(with_added_tokens=True))
    text = Path(tokenizer_file).read_text(encoding="utf-8")
    return llg.LLTokenizer(text, n_vocab=num_ids, eos_token=list(eos_token_ids) or None)


def short_error(message: str) -> str:
    """The reason of a llguidance error, without the parser state it appends."""
    message = message.split("\n<state>")[0].strip()
    return message if len(message) <= _MAX_ERROR_CHARS else message[:_MAX_ERROR_CHARS] + "..."
