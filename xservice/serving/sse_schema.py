"""OpenAPI documentation of the generation endpoints' two 200 responses: JSON, or a stream of events.

``stream_responses(Response, Chunk)`` goes into a route decorator's ``responses=``: the JSON body
(``stream: false``) and the ``text/event-stream`` body (``stream: true``). Before OpenAPI 3.2 the
``schema`` of an event stream describes one event, as tools read it: an object with the event's
``data`` (and ``event`` name); ``data`` is JSON text (``contentMediaType``) whose ``contentSchema``
is the chunk (or, after the stream started, OpenAI's error object), or the final ``[DONE]``.
``event_stream_schema`` builds such an event schema; the chunk schemas are self-contained (no
references).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from xservice.protocol.errors import ErrorResponse
from xservice.serving.streaming import DONE


def stream_responses(response_model: type[BaseModel], chunk_model: type[BaseModel]) -> dict[int | str, Any]:
    """``responses=`` for a route answering ``response_model`` or, with ``stream: true``, SSE chunks."""
    chunk_schema = inline_schema(chunk_model)
    chunk_schema["description"] = f"One {chunk_model.__name__}: the JSON of one event's 'data:'."
    description = (
        f"One server-sent event per chunk: 'data: <{chunk_model.__name__} JSON>' and a blank line. "
        f"After the last chunk (with 'stream_options.include_usage', a chunk carrying only 'usage') the "
        f"stream ends with '{DONE.strip()}'. An error after the stream started arrives as one "
        "'data: {\"error\": {...}}' event (OpenAI's error object) before '[DONE]'."
    )
    event = event_stream_schema(
        {"anyOf": [chunk_schema, inline_schema(ErrorResponse)]}, description, done=True
    )
    example = f"data: {{...{chunk_model.__name__}...}}\n\ndata: {{...{chunk_model.__name__}...}}\n\n{DONE}"
    return {
        200: {
            "model": response_model,
            "description": f"{response_model.__name__} as JSON; with 'stream: true', a text/event-stream "
            f"of {chunk_model.__name__} chunks ending with '{DONE.strip()}'.",
            "content": {"text/event-stream": {"schema": event, "example": example}},
        }
    }


def event_stream_schema(data_schema: dict[str, Any], description: str, *, done: bool) -> dict[str, Any]:
    """The schema of one server-sent event whose ``data`` is JSON matching ``data_schema`` (or, with
    ``done``, the final ``[DONE]``)."""
    data: dict[str, Any] = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": data_schema,
    }
    if done:
        data = {"anyOf": [data, {"const": DONE.removeprefix("data: ").strip()}]}
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": data, "event": {"type": "string", "description": "The event's name, if any."}},
        "description": description,
    }


def inline_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``model``'s JSON schema with its ``#/$defs/...`` references replaced by the definitions (the models
    are not recursive)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                rest = {k: v for k, v in node.items() if k != "$ref"}
                return {**resolve(defs[ref.removeprefix("#/$defs/")]), **resolve(rest)}
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return resolve(schema)
