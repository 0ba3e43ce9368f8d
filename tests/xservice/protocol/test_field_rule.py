"""The field rule: every request field is implemented, refused with a 400 naming it, or on the documented
list of fields without meaning here; unknown fields are refused; an explicit null means "not set"."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from xservice.protocol.field_table import DOC, field_statuses, request_models, updated_doc

# A minimal valid body per route that the HTTP part of this test sends fields on.
ROUTES: dict[str, tuple[str, dict[str, Any]]] = {
    "POST /v1/completions": ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    "POST /v1/chat/completions": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    ),
    "POST /v1/embeddings": ("/v1/embeddings", {"input": "hi"}),
    "POST /v1/responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
    "POST /tokenize": ("/tokenize", {"prompt": "hi"}),
}


def test_doc_lists_every_field_with_its_status() -> None:
    text = DOC.read_text()
    assert updated_doc(text) == text, (
        "docs/openai_compat.md is out of date; run `python -m xservice.protocol.field_table`"
    )


def test_each_field_has_one_status() -> None:
    for where, model in request_models().items():
        names = [r.name for r in field_statuses(model)]
        assert len(names) == len(set(names)), f"{where}: a field is in more than one state"
        for name, why in {**model.unsupported_fields, **model.ignored_fields}.items():
            assert why.strip(), f"{where}: '{name}' needs a reason"


def _cases(status: str) -> list[tuple[str, str]]:
    return [
        (where, r.name)
        for where in ROUTES
        for r in field_statuses(request_models()[where])
        if r.status == status
    ]


@pytest.mark.parametrize("where,name", _cases("refused"))
def test_refused_fields_are_400s_naming_them(http: httpx.Client, where: str, name: str) -> None:
    path, body = ROUTES[where]
    resp = http.post(path, json={**body, name: True})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == name and name in error["message"]


@pytest.mark.parametrize("where,name", _cases("ignored"))
def test_ignored_fields_are_accepted(http: httpx.Client, where: str, name: str) -> None:
    path, body = ROUTES[where]
    resp = http.post(path, json={**body, name: {"any": "value"} if name == "metadata" else "x"})
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("where", list(ROUTES))
def test_unknown_fields_are_refused(http: httpx.Client, where: str) -> None:
    path, body = ROUTES[where]
    resp = http.post(path, json={**body, "not_a_field": 1})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "not_a_field"
    assert "Unrecognized request argument" in error["message"]


def test_unknown_nested_fields_are_refused(http: httpx.Client) -> None:
    path, body = ROUTES["POST /v1/chat/completions"]
    messages = [{"role": "user", "content": "hi", "colour": "red"}]
    resp = http.post(path, json={**body, "messages": messages})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "messages.0.colour"


def test_refused_fields_may_be_null(http: httpx.Client) -> None:
    path, body = ROUTES["POST /v1/chat/completions"]
    refused = [name for w, name in _cases("refused") if w == "POST /v1/chat/completions"]
    resp = http.post(path, json={**body, **dict.fromkeys(refused)})
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize(
    "where,nulls",
    [
        ("POST /v1/completions", ["n", "stream", "echo", "logprobs", "best_of", "ignore_eos", "min_tokens"]),
        ("POST /v1/chat/completions", ["n", "stream", "logprobs", "top_logprobs", "stream_options"]),
    ],
)
def test_explicit_null_means_default(http: httpx.Client, where: str, nulls: list[str]) -> None:
    path, body = ROUTES[where]
    resp = http.post(path, json={**body, **dict.fromkeys(nulls)})
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"]) == 1
