"""``/openapi.json`` documents both 200 bodies of the generation routes (JSON and the SSE stream) and the
multipart body of ``POST /v1/files``; the streamed chunks a real server sends match the documented schema."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest


@pytest.fixture(scope="module")
def spec(http: httpx.Client) -> dict[str, Any]:
    resp = http.get("/openapi.json")
    assert resp.status_code == 200
    return resp.json()


def ok_response(spec: dict[str, Any], path: str) -> dict[str, Any]:
    return spec["paths"][path]["post"]["responses"]["200"]


@pytest.mark.parametrize(
    "path,body_schema,chunk_object",
    [
        ("/v1/completions", "CompletionResponse", "text_completion"),
        ("/v1/chat/completions", "ChatCompletionResponse", "chat.completion.chunk"),
    ],
)
def test_stream_response_is_documented(
    spec: dict[str, Any], path: str, body_schema: str, chunk_object: str
) -> None:
    response = ok_response(spec, path)
    content = response["content"]
    assert content["application/json"]["schema"] == {"$ref": f"#/components/schemas/{body_schema}"}
    stream = content["text/event-stream"]
    chunk = stream["schema"]
    assert chunk["type"] == "object" and chunk["properties"]["object"]["const"] == chunk_object
    assert "choices" in chunk["properties"] and "usage" in chunk["properties"]
    assert "$ref" not in json.dumps(chunk)  # self-contained
    assert "data: [DONE]" in chunk["description"] and "data: [DONE]" in response["description"]
    assert stream["example"].endswith("data: [DONE]\n\n")


def sse_chunks(text: str) -> list[Any]:
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 3, "logprobs": 1}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "logprobs": True},
        ),
    ],
)
def test_streamed_chunks_match_the_documented_schema(
    spec: dict[str, Any], http: httpx.Client, path: str, body: dict[str, Any]
) -> None:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    resp = http.post(path, json=body)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    chunks = sse_chunks(resp.text)
    assert chunks and chunks[-1]["usage"]["completion_tokens"] >= 1
    schema = ok_response(spec, path)["content"]["text/event-stream"]["schema"]
    for chunk in chunks:
        jsonschema.validate(chunk, schema)


def test_file_upload_body_is_documented(spec: dict[str, Any]) -> None:
    body = spec["paths"]["/v1/files"]["post"]["requestBody"]
    form = body["content"]["multipart/form-data"]["schema"]
    assert body["required"] and set(form["required"]) == {"file", "purpose"}
    assert form["properties"]["file"]["format"] == "binary"
