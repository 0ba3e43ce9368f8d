"""Hazard corpus, counts: a body with more messages, content parts, tools, ``logit_bias`` keys, stop strings,
bad words or choices than the service accepts is refused by a cheap count before it is validated, with a
400 naming the field and the limit (OpenAI's ``array_above_max_length`` code), on every route that takes
the field; ``service.max_messages`` / ``service.max_content_parts`` set two of the limits."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from xengine.api.constraints import MAX_BAD_WORDS, MAX_CHOICES, MAX_LOGIT_BIAS_ENTRIES
from xengine.api.sampling_params import MAX_STOP_STRINGS
from xservice.http.errors import InvalidRequestError
from xservice.serving.request_limits import TOO_MANY, RequestLimits, check_counts
from xservice.serving.tools.plan import MAX_TOOLS

MAX_MESSAGES = 6
MAX_PARTS = 10
LIMITS = RequestLimits(max_messages=MAX_MESSAGES, max_content_parts=MAX_PARTS)


def user(content: Any = "hi") -> dict[str, Any]:
    return {"role": "user", "content": content}


def parts(n: int) -> list[dict[str, Any]]:
    return [{"type": "text", "text": "x"} for _ in range(n)]


def tool(i: int) -> dict[str, Any]:
    return {"type": "function", "function": {"name": f"f{i}"}}


# (route, body, param, limit in the message): one over each limit
OVER: list[tuple[str, dict[str, Any], str, int]] = [
    ("/v1/chat/completions", {"messages": [user()] * (MAX_MESSAGES + 1)}, "messages", MAX_MESSAGES),
    (
        "/v1/chat/completions",
        {"messages": [user(parts(4)), user(parts(4)), user(parts(3))]},
        "messages.2.content",
        MAX_PARTS,
    ),
    ("/tokenize", {"messages": [user()] * (MAX_MESSAGES + 1)}, "messages", MAX_MESSAGES),
    ("/invocations", {"messages": [user(parts(MAX_PARTS + 1))]}, "messages.0.content", MAX_PARTS),
    (
        "/v1/chat/completions/batch",
        {"messages": [[user()] * 4, [user()] * 3]},  # the conversations' messages count together
        "messages",
        MAX_MESSAGES,
    ),
    ("/v1/responses", {"input": [user()] * (MAX_MESSAGES + 1)}, "input", MAX_MESSAGES),
    ("/v1/responses", {"input": [user(parts(MAX_PARTS + 1))]}, "input.0.content", MAX_PARTS),
    (
        "/v1/chat/completions",
        {"messages": [user()], "tools": [tool(i) for i in range(MAX_TOOLS + 1)]},
        "tools",
        MAX_TOOLS,
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}},
        "logit_bias",
        MAX_LOGIT_BIAS_ENTRIES,
    ),
    ("/v1/completions", {"prompt": "hi", "stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop", MAX_STOP_STRINGS),
    (
        "/v1/completions",
        {"prompt": "hi", "bad_words": ["w"] * (MAX_BAD_WORDS + 1)},
        "bad_words",
        MAX_BAD_WORDS,
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "guided_choice": ["c"] * (MAX_CHOICES + 1)},
        "guided_choice",
        MAX_CHOICES,
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "structured_outputs": {"choice": ["c"] * (MAX_CHOICES + 1)}},
        "structured_outputs.choice",
        MAX_CHOICES,
    ),
]
IDS = [f"{route}-{param}" for route, _, param, _ in OVER]


@pytest.mark.parametrize("route,body,param,limit", OVER, ids=IDS)
def test_counts_refuse_one_over_each_limit(route: str, body: dict[str, Any], param: str, limit: int) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        check_counts(body, LIMITS)
    assert caught.value.param == param and caught.value.code == TOO_MANY
    assert f"At most {limit} " in caught.value.message


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [user(parts(2))] * 5},  # 10 parts, 5 messages: at the limits
        {"messages": [[user()] * 3, [user()] * 3]},
        {"input": [user(parts(MAX_PARTS))], "tools": [tool(i) for i in range(MAX_TOOLS)]},
        {"input": ["a text"] * 100},  # embeddings inputs: counted by their own route
        {"messages": "not a list", "tools": "nor this", "logit_bias": 3},  # left to validation
        ["not", "an", "object"],
        # item types of any JSON type: left to validation (a list or object type once raised TypeError)
        {"input": [{"type": ["message"]}, {"type": {"a": 1}}, {"type": None}, {"type": 3}]},
    ],
)
def test_counts_accept_what_is_within_limits(body: Any) -> None:
    check_counts(body, LIMITS)


# ---------------------------------------------------------------- on a real server


@pytest.fixture(scope="module")
def limited(launch_server, model_dir) -> Iterator[Any]:
    """A server with small message and part limits (the default body bound)."""
    handle = launch_server(model_dir, {"max_messages": MAX_MESSAGES, "max_content_parts": MAX_PARTS})
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def conn(limited: Any) -> Iterator[httpx.Client]:
    with limited.client() as client:
        yield client


@pytest.mark.parametrize("route,body,param,limit", OVER, ids=IDS)
def test_server_refuses_one_over_each_limit(
    conn: httpx.Client, route: str, body: dict[str, Any], param: str, limit: int
) -> None:
    resp = conn.post(route, json={**body, "max_tokens": 1} if "prompt" in body else body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["code"] == TOO_MANY, err
    assert f"At most {limit} " in err["message"], err


def test_server_serves_at_the_limits(conn: httpx.Client) -> None:
    body = {"messages": [user(parts(2))] * (MAX_MESSAGES - 1), "max_tokens": 2, "temperature": 0}
    resp = conn.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] >= 1


def test_item_type_of_any_json_type_is_a_400(conn: httpx.Client) -> None:
    """What a fuzzing run found: an input item whose type is a list or object (the counts looked it up
    as a key) is a 400 at that item's type, not a 500."""
    for kind in (["message"], {"a": 1}):
        body = {"input": [{"role": "user", "content": "hi"}, {"type": kind, "content": []}]}
        resp = conn.post("/v1/responses", json=body)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "input.1.type", resp.text


def test_counts_come_before_validation(conn: httpx.Client) -> None:
    """A body over a count is refused for the count, whatever else is wrong in it (nothing was validated)."""
    body = {"messages": [{"role": "nobody", "content": 5}] * (MAX_MESSAGES + 1), "n": "two"}
    resp = conn.post(
        "/v1/chat/completions", content=json.dumps(body), headers={"Content-Type": "application/json"}
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages", resp.text
