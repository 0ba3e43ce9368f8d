"""OpenAPI documentation of the generation endpoints' two 200 responses: JSON, or a stream of chunks.

``stream_responses(Response, Chunk)`` goes into a route decorator's ``responses=``: the JSON body
(``stream: false``) and the ``text/event-stream`` body (``stream: true``), whose schema is one
chunk object, self-contained (no references), since each event's ``data:`` is one chunk in JSON.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from xservice.serving.streaming import DONE


def stream_responses(response_model: type[BaseModel], chunk_model: type[BaseModel]) -> dict[int | str, Any]:
    """``responses=`` for a route answering ``response_model`` or, with ``stream: true``, SSE chunks."""
    chunk_schema = _inline_refs(chunk_model.model_json_schema())
    chunk_schema["description"] = (
        f"One server-sent event per chunk: 'data: <{chunk_model.__name__} JSON>' and a blank line. "
        f"After the last chunk (with 'stream_options.include_usage', a chunk carrying only 'usage') the "
        f"stream ends with '{DONE.strip()}'. An error after the stream started arrives as one "
        "'data: {\"error\": {...}}' event (OpenAI's error object) before '[DONE]'."
    )
    example = f"data: {{...{chunk_model.__name__}...}}\n\ndata: {{...{chunk_model.__name__}...}}\n\n{DONE}"
    return {
        200: {
            "model": response_model,
            "description": f"{response_model.__name__} as JSON; with 'stream: true', a text/event-stream "
            f"of {chunk_model.__name__} chunks ending with '{DONE.strip()}'.",
            "content": {"text/event-stream": {"schema": chunk_schema, "example": example}},
        }
    }


def _inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with its ``#/$defs/...`` references replaced by the definitions (models are not recursive)."""
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
