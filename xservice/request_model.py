"""``RequestModel``: the base of every request body, rejecting JSON values no field can carry safely.

Python's ``json`` decoder accepts what later layers cannot: lone UTF-16 surrogates (``"\\ud800"``:
not Unicode, so encoding them to UTF-8 for the tokenizer, a log line or a response fails),
integers of any size (msgspec frames to the engine hold at most 64 bits) and ``NaN`` / ``Infinity``
(``1e400`` decodes to ``inf``). One check before field validation refuses them anywhere in a body,
known field or not, as a validation error at the offending path, so every route answers 400 naming
the field instead of failing later with a 500.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


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
    """Base of request bodies: unsafe JSON values anywhere in the input are a validation error."""

    @model_validator(mode="before")
    @classmethod
    def _reject_unsafe_values(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # not an object: the model's own type error says so
        found = find_unsafe_value(data)
        if found is None:
            return data
        path, reason = found
        # A ValidationError raised here keeps ``path`` (prefixed by where this model sits), so
        # the error names the field, not the whole body.
        error = PydanticCustomError("unsafe_value", "{reason}", {"reason": reason})
        details = InitErrorDetails(type=error, loc=path, input=None)
        raise ValidationError.from_exception_data(cls.__name__, [details])
