"""``RequestModel``: lone surrogates, integers outside int64 and non-finite numbers are refused at their path."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from xservice.protocol import ChatCompletionRequest, CompletionRequest
from xservice.protocol.request_model import INT64_MAX, INT64_MIN, RequestModel, find_unsafe_value
from xservice.rec.protocol import CatalogCreateRequest
from xservice.routes.batches import CreateBatchRequest


def decoded(text: str) -> Any:
    """What the service's JSON decoder makes of ``text`` (escapes such as ``\\ud800`` included)."""
    return json.loads(text)


@pytest.mark.parametrize(
    "text,path",
    [
        ('{"a": "\\ud800"}', ("a",)),
        ('{"a": ["ok", {"b": "x\\udfffy"}]}', ("a", 1, "b")),
        ('{"a": 18446744073709551616}', ("a",)),
        (f'{{"a": [[1, {INT64_MAX + 1}]]}}', ("a", 0, 1)),
        (f'{{"a": {INT64_MIN - 1}}}', ("a",)),
        ('{"a": NaN}', ("a",)),
        ('{"a": {"b": 1e400}}', ("a", "b")),
        ('{"a": -Infinity}', ("a",)),
        ('{"ok": 1, "\\ud800": 1}', ("\\ud800",)),  # a bad field name, shown escaped
    ],
)
def test_finds_the_first_unsafe_value(text: str, path: tuple) -> None:
    found = find_unsafe_value(decoded(text))
    assert found is not None and found[0] == path


@pytest.mark.parametrize(
    "value",
    [
        {"a": "\U0001f600 caf\u00e9", "b": [INT64_MIN, INT64_MAX, 0, True, None, 1.5e308, -0.0]},
        decoded('{"pair": "\\ud83d\\ude00"}'),  # a surrogate *pair* is one valid character
        [],
        "plain",
    ],
)
def test_accepts_safe_values(value: Any) -> None:
    assert find_unsafe_value(value) is None


def test_deep_nesting_does_not_recurse() -> None:
    deep: Any = "\ud800"
    for _ in range(5_000):  # deeper than Python's recursion limit
        deep = [deep]
    found = find_unsafe_value({"a": deep})
    assert found is not None and len(found[0]) == 5_001


@pytest.mark.parametrize(
    "model,body,loc",
    [
        (CompletionRequest, {"prompt": "\ud800"}, ("prompt",)),
        (CompletionRequest, {"prompt": "hi", "seed": 2**64}, ("seed",)),
        (CompletionRequest, {"prompt": [[1, 2], [3, -(2**63) - 1]]}, ("prompt", 1, 1)),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": "\udc00"}]},
            ("messages", 0, "content"),
        ),
        (CatalogCreateRequest, {"name": "c", "items": [[1, 2**70]]}, ("items", 0, 1)),
        (
            CreateBatchRequest,
            {"input_file_id": "f", "endpoint": "e", "metadata": {"k": "\ud800"}},
            ("metadata", "k"),
        ),
    ],
)
def test_request_models_report_the_path(model: type[RequestModel], body: dict, loc: tuple) -> None:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    errors = info.value.errors()
    assert [e["loc"] for e in errors] == [loc]
    assert errors[0]["type"] == "unsafe_value"


def test_int64_bounds_are_accepted() -> None:
    body = CompletionRequest.model_validate({"prompt": "hi", "seed": INT64_MAX, "top_k": INT64_MIN})
    assert (body.seed, body.top_k) == (INT64_MAX, INT64_MIN)
