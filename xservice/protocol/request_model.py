"""``RequestModel``: the base of every request body: the field rule, and no JSON value a field cannot carry.

**The field rule.** Every field of a request body is either implemented (a field of the model), or
rejected with a 400 naming it (``unsupported_fields``: the field and why), or accepted and ignored
because it has no meaning on a self-hosted server (``ignored_fields``, documented in
``docs/openai_compat.md``). Any other field is refused like OpenAI does ("Unrecognized request
argument supplied"). An explicit JSON ``null`` means "not set" (the default), as in OpenAI's API,
also for fields whose value cannot be null.


Python's ``json`` decoder accepts what later layers cannot: lone UTF-16 surrogates (``"\\ud800"``:
not Unicode, so encoding them to UTF-8 for the tokenizer, a log line or a response fails),
integers of any size (msgspec frames to the engine hold at most 64 bits) and ``NaN`` / ``Infinity``
(``1e400`` decodes to ``inf``). One check before field validation refuses them anywhere in a body,
known field or not, as a validation error at the offending path, so every route answers 400 naming
the field instead of failing later with a 500. The body is walked once, by its outermost model.
"""

from __future__ import annotations

import functools
import math
import types
import typing
from contextvars import ContextVar
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ModelWrapValidatorHandler, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

# Set while the outermost request model validates: the body was walked once by ``find_unsafe_value``,
# so the models nested in it skip the walk (walking at every level made validation quadratic in depth:
# a chat body's parts were walked three times).
_WALKED: ContextVar[bool] = ContextVar("xllm_request_walked", default=False)


def find_unsafe_value(data: Any) -> tuple[tuple[str | int, ...], str] | None:
    """The path and reason of the first unsafe value in decoded JSON ``data``, or None.

    Iterative, so a deeply nested body cannot exhaust the stack.
    """
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), data)]
    while stack:
        path, value = stack.pop()
        reason = _unsafe_scalar(value)
        if reason is not None:
            return path, reason
        if isinstance(value, dict):
            for key, item in reversed(list(value.items())):
                if isinstance(key, str) and (key_reason := _unsafe_scalar(key)) is not None:
                    shown = key.encode("utf-8", "backslashreplace").decode("utf-8")
                    return (*path, shown), f"field name: {key_reason}"
                stack.append(((*path, key), item))
        elif isinstance(value, list | tuple):
            if _all_int64(value):  # token-id lists: checked at C speed, not element by element
                continue
            stack.extend(((*path, i), item) for i, item in reversed(list(enumerate(value))))
    return None


def _all_int64(values: list[Any] | tuple[Any, ...]) -> bool:
    """True for a non-empty list of plain ints all inside int64 (then nothing in it is unsafe)."""
    if not values or not all(type(v) is int for v in values):
        return False
    return INT64_MIN <= min(values) and max(values) <= INT64_MAX


def _unsafe_scalar(value: Any) -> str | None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            code = ord(value[e.start])
            return f"contains a lone UTF-16 surrogate (U+{code:04X}); strings must be valid Unicode"
        return None
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
        return "integer out of range; integers must be in [-2^63, 2^63 - 1]"
    if isinstance(value, float) and not math.isfinite(value):
        return "not a finite number; NaN, Infinity and out-of-range exponents are not accepted"
    return None


class RequestModel(BaseModel):
    """Base of request bodies: unsafe JSON values anywhere in the input and fields outside the field
    rule are validation errors (400s naming the field)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    # field -> why it is refused: a non-null value is a 400 naming the field
    unsupported_fields: ClassVar[dict[str, str]] = {}
    # field -> why it has no meaning here: accepted (any value) and dropped
    ignored_fields: ClassVar[dict[str, str]] = {}

    @model_validator(mode="wrap")
    @classmethod
    def _check_values(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        """Unsafe values, once per body: the outermost request model walks it, models nested in it skip."""
        if not isinstance(data, dict) or _WALKED.get():
            return handler(data)
        found = find_unsafe_value(data)
        if found is not None:
            path, reason = found
            _raise(cls, "unsafe_value", path, reason)
        token = _WALKED.set(True)
        try:
            return handler(data)
        finally:
            _WALKED.reset(token)

    @model_validator(mode="before")
    @classmethod
    def _check_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # not an object: the model's own type error says so
        return _apply_field_rule(cls, data)


def _raise(cls: type[BaseModel], kind: str, path: tuple[str | int, ...], reason: str) -> None:
    # A ValidationError raised here keeps ``path`` (prefixed by where this model sits), so the
    # error names the field, not the whole body.
    error = PydanticCustomError(kind, "{reason}", {"reason": reason})
    details = InitErrorDetails(type=error, loc=path, input=None)
    raise ValidationError.from_exception_data(cls.__name__, [details])


@functools.cache
def _field_names(cls: type[RequestModel]) -> tuple[frozenset[str], frozenset[str]]:
    """The names a body of ``cls`` may use (aliases too), and those of fields that cannot hold None."""
    fields = cls.model_fields
    known = frozenset(fields) | {f.alias for f in fields.values() if f.alias}
    not_null = frozenset(name for name, f in fields.items() if not accepts_none(f.annotation))
    return known, not_null


def _apply_field_rule(cls: type[RequestModel], data: dict[str, Any]) -> dict[str, Any]:
    known, not_null = _field_names(cls)
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in cls.ignored_fields:
            continue
        if key in cls.unsupported_fields:
            if value is not None:
                _raise(cls, "unsupported_field", (key,), f"not supported: {cls.unsupported_fields[key]}")
            continue
        if key not in known:
            if cls.model_config.get("extra") != "forbid":
                out[key] = value
                continue
            _raise(cls, "unrecognized_field", (key,), "Unrecognized request argument supplied")
        if value is None and key in not_null:
            continue  # explicit null: the default
        out[key] = value
    return out


def accepts_none(annotation: Any) -> bool:
    """Whether a field annotated ``annotation`` can hold None."""
    if annotation is None or annotation is type(None) or annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return any(accepts_none(a) for a in typing.get_args(annotation))
    if origin is typing.Annotated:
        return accepts_none(typing.get_args(annotation)[0])
    return False
