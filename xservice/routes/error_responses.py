"""The error responses ``/openapi.json`` documents, in OpenAI's error shape (``ErrorResponse``).

Every route can answer 400 (a malformed request; the body bound also checks ``Content-Length`` on
every route), 413 (a body over the limit) and 500 (a bug), and 401 when the server has an API key
(every route but the health probes): ``common_errors`` lists them for ``include_router``. Each route
adds its own with ``errors(...)`` in its decorator: 404 (an unknown model or id), 409 (a state that
refuses the request), 429 (too many requests in flight), 503 (no engine can serve). FastAPI's own
422 is dropped from the document (``drop_validation_422``): request validation errors are 400s
here (``xservice/http/errors.py``), so a client or fuzzer that checks status codes finds each one the
server sends documented.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute

from xservice.protocol.errors import ErrorResponse

DESCRIPTIONS: dict[int, str] = {
    400: "Invalid request: malformed JSON, a field of the wrong type, value or count (param names it).",
    401: "Missing or wrong API key ('Authorization: Bearer <key>').",
    404: "The model, or the object the path names, does not exist.",
    409: "The request is valid, but the current state (or a quota) refuses it.",
    413: "The request body (or the uploaded file) is larger than the server accepts.",
    429: "Too many requests in flight; retry after the 'Retry-After' seconds.",
    500: "An internal error.",
    503: "No engine can serve right now (starting, restarting or gone); retry after 'Retry-After'.",
}
RETRY_HEADER = {
    "Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "integer"}}
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries documenting ``statuses`` with the error body (and ``Retry-After`` on 429/503)."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        entry: dict[str, Any] = {"model": ErrorResponse, "description": DESCRIPTIONS[status]}
        if status in (429, 503):
            entry["headers"] = RETRY_HEADER
        out[status] = entry
    return out


# What a generation route answers beyond the common errors: an unknown model, too many in flight, no engine.
GENERATION_ERRORS = (404, 429, 503)


def common_errors(api_key: bool) -> dict[int | str, dict[str, Any]]:
    """The errors of every route: 400, 413, 500, and 401 when an API key guards the route."""
    return errors(400, 401, 413, 500) if api_key else errors(400, 413, 500)


def declare_errors(router: APIRouter, table: dict[str, tuple[int, ...]]) -> None:
    """Document, for the routes of ``router`` named in ``table`` ("METHOD /path"), the errors they answer
    (for routers whose modules do not declare them in their decorators)."""
    for route in router.routes:
        if isinstance(route, APIRoute):
            for method in route.methods:
                statuses = table.get(f"{method} {route.path}")
                if statuses:
                    route.responses = {**route.responses, **errors(*statuses)}


def drop_validation_422(app: FastAPI) -> None:
    """Make ``app.openapi()`` leave out FastAPI's 422 response and its schemas (this API never sends 422)."""
    generate: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()  # FastAPI's document, kept as app.openapi_schema
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
