"""``/openapi.json`` documents both 200 bodies of the generation routes (JSON and the SSE stream), the
multipart body of ``POST /v1/files`` and every error status a route answers (OpenAI's error object; no
422); the streamed chunks and errors a real server sends match the documented schemas."""

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
    event = stream["schema"]  # one event, as tools read a stream: its "data" (and "event" name)
    assert event["required"] == ["data"] and "data: [DONE]" in event["description"]
    chunk_or_done = event["properties"]["data"]["anyOf"]
    assert {"const": "[DONE]"} in chunk_or_done
    data = next(d for d in chunk_or_done if "contentSchema" in d)
    assert data["contentMediaType"] == "application/json"
    chunk, error = data["contentSchema"]["anyOf"]
    assert chunk["type"] == "object" and chunk["properties"]["object"]["const"] == chunk_object
    assert "choices" in chunk["properties"] and "usage" in chunk["properties"]
    assert set(error["properties"]) == {"error"}  # an error after the stream started
    assert "$ref" not in json.dumps(event)  # self-contained
    assert "data: [DONE]" in response["description"]
    assert stream["example"].endswith("data: [DONE]\n\n")


def chunk_schema(spec: dict[str, Any], path: str) -> dict[str, Any]:
    """The documented schema of one streamed chunk (the JSON in an event's ``data``)."""
    event = ok_response(spec, path)["content"]["text/event-stream"]["schema"]
    data = next(d for d in event["properties"]["data"]["anyOf"] if "contentSchema" in d)
    return data["contentSchema"]["anyOf"][0]


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
    schema = chunk_schema(spec, path)
    for chunk in chunks:
        jsonschema.validate(chunk, schema)


def test_file_upload_body_is_documented(spec: dict[str, Any]) -> None:
    body = spec["paths"]["/v1/files"]["post"]["requestBody"]
    form = body["content"]["multipart/form-data"]["schema"]
    assert body["required"] and set(form["required"]) == {"file", "purpose"}
    assert form["properties"]["file"]["format"] == "binary"


# ---------------------------------------------------------------- error responses

ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
GENERATION_ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/chat/completions/batch",
    "/v1/responses",
    "/v1/embeddings",
    "/invocations",
    "/v1/rec/generate",
)


def operations(spec: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(method, path, op) for path, ops in spec["paths"].items() for method, op in ops.items()]


def test_every_route_documents_openai_errors_and_no_422(spec: dict[str, Any]) -> None:
    """Validation errors are 400s here: no route documents FastAPI's 422; every one documents the errors any
    request can get (400, 413, 500) with OpenAI's error object."""
    for method, path, op in operations(spec):
        responses = op["responses"]
        assert "422" not in responses, (method, path)
        for status in ("400", "413", "500"):
            assert responses[status]["content"]["application/json"]["schema"] == ERROR_REF, (method, path)
        assert "401" not in responses, (method, path)  # this server has no API key
    schemas = spec["components"]["schemas"]
    assert not {"HTTPValidationError", "ValidationError"} & set(schemas)
    detail = schemas["ErrorDetail"]
    assert set(detail["required"]) == {"message", "type", "param", "code"}
    assert schemas["ErrorResponse"]["properties"]["error"] == {"$ref": "#/components/schemas/ErrorDetail"}


@pytest.mark.parametrize("path", GENERATION_ROUTES)
def test_generation_routes_document_404_429_503(spec: dict[str, Any], path: str) -> None:
    responses = spec["paths"][path]["post"]["responses"]
    for status in ("404", "429", "503"):
        assert responses[status]["content"]["application/json"]["schema"] == ERROR_REF
    for status in ("429", "503"):
        assert "Retry-After" in responses[status]["headers"]


def test_routes_of_other_modules_document_their_errors(spec: dict[str, Any]) -> None:
    """Every route the app's table names exists, and documents the table's statuses."""
    from xservice.http.app import OTHER_ROUTE_ERRORS

    for route, statuses in OTHER_ROUTE_ERRORS.items():
        method, path = route.split(" ", 1)
        responses = spec["paths"][path][method.lower()]["responses"]
        assert {str(s) for s in statuses} <= set(responses), route


@pytest.mark.parametrize(
    "method,path,body,status",
    [
        ("GET", "/v1/models/no-such-model", None, 404),
        ("GET", "/v1/responses/resp_nope", None, 404),
        ("POST", "/v1/completions", {"model": "no-such-model", "prompt": "hi"}, 404),
        ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400),
        ("POST", "/tokenize", {"prompt": "x" * 70_000}, 413),
    ],
)
def test_errors_a_server_sends_are_documented(
    spec: dict[str, Any], http: httpx.Client, method: str, path: str, body: Any, status: int
) -> None:
    resp = http.request(method, path, json=body)
    assert resp.status_code == status, resp.text
    documented = {
        "/v1/models/no-such-model": "/v1/models/{model_id}",
        "/v1/responses/resp_nope": "/v1/responses/{response_id}",
    }
    doc = spec["paths"][documented.get(path, path)][method.lower()]["responses"][str(status)]
    jsonschema.validate(
        resp.json(), {**doc["content"]["application/json"]["schema"], "components": spec["components"]}
    )
