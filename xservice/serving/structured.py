"""The token-level constraint fields of a request → engine ``SamplingParams`` fields; each failure is a
400 naming the field the client sent.

Structured outputs come from OpenAI's ``response_format``, vLLM's ``structured_outputs`` or its older
``guided_*`` fields. As in vLLM, ``response_format`` replaces the constraint of ``structured_outputs``
but keeps its options (``disable_any_whitespace``, ...); ``structured_outputs`` and ``guided_*`` are
two spellings of one thing and may not be mixed. The schema, regex or grammar is checked here with
the engine backend's own validator (tokenizer-free, ``xengine.api.grammar.check_spec``, which bounds
the spec and runs the validator in a sandbox process: a crafted spec cannot crash the service), so
an invalid one is a 400 before anything streams; the engine's compile stays the authority. The
check can take up to the sandbox's timeout, so servers call ``check_structured_outputs`` (off the
event loop) before building the request's params, which then find the spec already known.

``bad_words`` are tokenized here like vLLM does: each word as written (leading spaces stripped) and
with one leading space, since a byte-level BPE has different ids for the two; the engine bans a
sequence's last token wherever the output ends with the rest of it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from xengine.api.grammar import GrammarSpec, check_spec, grammar_spec
from xengine.api.messages import StructuredOutputsParams
from xservice.http.errors import InvalidRequestError
from xservice.protocol import SamplingRequest

if TYPE_CHECKING:
    from xengine.api.text.tokenizer import Tokenizer

BACKEND_NAMES = ("auto", "llguidance", "guidance")  # accepted values of guided_decoding_backend
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_MAX_CHECKED_SPECS = 4096  # digests of valid specs remembered (~100 bytes each)


@dataclass
class Constraints:
    """The engine fields, and engine field -> API field for errors the engine reports later."""

    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    rename: dict[str, str] = field(default_factory=dict)


def _bad(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(f"invalid value for '{param}': {message}", param=param)


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        return schema  # checked as JSON by StructuredOutputsParams.validate
    if schema is None:
        raise _bad("a JSON schema is required", param)
    return json.dumps(schema, ensure_ascii=False)


def structured_field(body: SamplingRequest) -> str | None:
    """The API field the request's structured-output constraint comes from (for error messages)."""
    rf = body.response_format
    if rf is not None and rf.type != "text":
        return "response_format"
    if body.structured_outputs is not None:
        return "structured_outputs"
    return next((name for name in _GUIDED if getattr(body, name) is not None), None)


def _from_guided(body: SamplingRequest) -> dict[str, Any]:
    given = [name for name in _GUIDED if getattr(body, name) is not None]
    if len(given) > 1:
        raise _bad(f"set one of {', '.join(_GUIDED)}, not {' and '.join(given)}", given[1])
    if body.structured_outputs is not None and given:
        raise _bad("'structured_outputs' and guided_* are two spellings of one field: use one", given[0])
    backend = body.guided_decoding_backend
    if backend is not None and backend not in BACKEND_NAMES:
        raise _bad(f"this server's structured-output backend is llguidance; use one of {BACKEND_NAMES}",
                   "guided_decoding_backend")  # fmt: skip
    out: dict[str, Any] = {}
    if body.guided_whitespace_pattern is not None:
        out["whitespace_pattern"] = body.guided_whitespace_pattern
    if not given:
        return out
    name = given[0]
    value = getattr(body, name)
    kind = name.removeprefix("guided_")
    out[kind] = _schema_text(value, name) if kind == "json" else value
    return out


def _from_structured_outputs(body: SamplingRequest) -> dict[str, Any]:
    so = body.structured_outputs
    if so is None:
        return {}
    out: dict[str, Any] = {"disable_any_whitespace": so.disable_any_whitespace}
    if so.disable_additional_properties is not None:
        out["disable_additional_properties"] = so.disable_additional_properties
    if so.whitespace_pattern is not None:
        out["whitespace_pattern"] = so.whitespace_pattern
    if so.json_ is not None:
        out["json"] = _schema_text(so.json_, "structured_outputs")
    for name in ("regex", "choice", "grammar"):
        if getattr(so, name) is not None:
            out[name] = getattr(so, name)
    if so.json_object:
        out["json_object"] = True
    return out


def _from_response_format(body: SamplingRequest) -> dict[str, Any] | None:
    """The constraint ``response_format`` sets (replacing any other), or None (absent / text)."""
    rf = body.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "structural_tag":
        raise _bad("structural tags are not supported; use 'json_schema' or 'json_object'", "response_format")
    if rf.type == "json_object":
        return {"json_object": True}
    if rf.json_schema is None:
        raise _bad("type 'json_schema' needs a 'json_schema' object with a 'schema'", "response_format")
    return {"json": _schema_text(rf.json_schema.schema_, "response_format")}


def structured_outputs(body: SamplingRequest) -> StructuredOutputsParams | None:
    """The engine's structured-output params of ``body`` (None: unconstrained); 400 when invalid."""
    fields = _from_guided(body) | _from_structured_outputs(body)
    override = _from_response_format(body)
    if override is not None:
        for kind in ("json", "json_object", "regex", "choice", "grammar"):
            fields.pop(kind, None)
        fields |= override
    param = structured_field(body)
    if param is None:
        if "whitespace_pattern" in fields:
            raise _bad("applies only to a JSON constraint (guided_json)", "guided_whitespace_pattern")
        return None
    if "json" in fields:  # a schema's objects closed unless it or the request says otherwise (as vLLM)
        fields.setdefault("disable_additional_properties", body._closed_objects)
    params = StructuredOutputsParams(**fields)
    try:
        params.validate()
        _check(grammar_spec(params))
    except ValueError as exc:
        reason = str(exc).removeprefix("invalid value for 'structured_outputs': ")
        raise _bad(reason, param) from None
    return params


async def check_structured_outputs(body: SamplingRequest) -> None:
    """Validate ``body``'s structured-output constraint off the event loop (400 naming the field when
    invalid); afterwards ``structured_outputs(body)`` finds a valid spec already checked."""
    if structured_field(body) is not None:
        await asyncio.to_thread(structured_outputs, body)


class _CheckedSpecs:
    """Digests of specs that passed ``check_spec`` (clients repeat their schemas), LRU-bounded, so a
    repeated spec costs no sandbox round trip whatever its size. Errors are not remembered."""

    def __init__(self, max_entries: int) -> None:
        self._digests: OrderedDict[bytes, None] = OrderedDict()
        self._max_entries = max_entries
        self._lock = threading.Lock()

    def check(self, spec: GrammarSpec) -> None:
        digest = _digest(spec)
        with self._lock:
            if digest in self._digests:
                self._digests.move_to_end(digest)
                return
        check_spec(spec)
        with self._lock:
            self._digests[digest] = None
            while len(self._digests) > self._max_entries:
                self._digests.popitem(last=False)


def _digest(spec: GrammarSpec) -> bytes:
    h = hashlib.sha256(f"{spec.kind}\0{spec.whitespace}\0".encode())
    h.update(spec.source.encode("utf-8", "surrogatepass"))
    return h.digest()


_checked = _CheckedSpecs(_MAX_CHECKED_SPECS)


def _check(spec: GrammarSpec) -> None:
    _checked.check(spec)


def logit_bias(body: SamplingRequest) -> dict[int, float] | None:
    """``{"<token id>": bias}`` with integer keys (their range and the values: ``SamplingParams.validate``)."""
    if body.logit_bias is None:
        return None
    bad = [key for key in body.logit_bias if not _is_int(key)]
    if bad:  # all of them, so a client fixes its request once
        got = ", ".join(repr(key) for key in bad[:10]) + (
            f" and {len(bad) - 10} more" if len(bad) > 10 else ""
        )
        raise _bad(f"keys must be token ids (integers as strings), got {got}", "logit_bias")
    return {int(key): value for key, value in body.logit_bias.items()}


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def bad_words_token_ids(words: list[str] | None, tokenizer: Tokenizer) -> list[list[int]] | None:
    """Each word's token ids as written and after a space (distinct sequences only)."""
    if words is None:
        return None
    out: list[list[int]] = []
    for word in words:
        text = word.lstrip()
        if not text:
            raise _bad("bad words must not be empty or blank", "bad_words")
        for variant in (text, " " + text):
            ids = tokenizer.encode(variant, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out


def constraints(body: SamplingRequest, tokenizer: Tokenizer | None) -> Constraints:
    """Every constraint of ``body`` as engine fields (400 naming the field when one is invalid)."""
    so = structured_outputs(body)
    bad_words = None
    if body.bad_words:
        if tokenizer is None:
            raise _bad("needs the served model's tokenizer", "bad_words")
        bad_words = bad_words_token_ids(body.bad_words, tokenizer)
    rename = {"bad_words_token_ids": "bad_words"}
    if so is not None:
        rename["structured_outputs"] = structured_field(body) or "structured_outputs"
    return Constraints(so, logit_bias(body), body.allowed_token_ids, bad_words, rename)


def constraint_rename(body: SamplingRequest) -> dict[str, str]:
    """Engine field -> the API field the client used, for errors the engine reports."""
    rename = {"bad_words_token_ids": "bad_words"}
    param = structured_field(body)
    if param is not None:
        rename["structured_outputs"] = param
    return rename
