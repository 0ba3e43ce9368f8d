"""API errors and the one place that maps them to HTTP responses in OpenAI's error shape.

Every error leaves the service as ``{"error": {"message", "type", "param", "code"}}``. Handlers
are installed for our own ``APIError`` family, FastAPI's request validation errors (malformed JSON,
wrong types), Starlette's ``HTTPException`` (unknown route, wrong method) and, last, any other
exception (500 without a traceback in the body).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1


class APIError(Exception):
    """Base of every error the API reports; subclasses pick the status in ``_STATUS``."""

    default_code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.default_code
        self.headers = headers


class InvalidRequestError(APIError):
    """A client mistake in the request body (400)."""


class AuthenticationError(APIError):
    default_code = "invalid_api_key"


class NotFoundError(APIError):
    default_code = "not_found"


class ModelNotFoundError(NotFoundError):
    default_code = "model_not_found"


class ConflictError(APIError):
    """The request is valid but the current state refuses it (409)."""

    default_code = "conflict"


class RequestTooLargeError(APIError):
    default_code = "request_too_large"


class RateLimitError(APIError):
    default_code = "rate_limit_exceeded"

    def __init__(self, message: str, **kw: Any) -> None:
        super().__init__(message, headers={"Retry-After": str(RETRY_AFTER_S)}, **kw)


class EngineUnavailableError(APIError):
    default_code = "engine_unavailable"

    def __init__(self, message: str = "The engine is not available; retry later.", **kw: Any) -> None:
        super().__init__(message, headers={"Retry-After": str(RETRY_AFTER_S)}, **kw)


class InternalError(APIError):
    default_code = "internal_error"


# The one exception -> (HTTP status, OpenAI error type) table. Most specific class first.
_STATUS: list[tuple[type[APIError], int, str]] = [
    (InvalidRequestError, 400, "invalid_request_error"),
    (AuthenticationError, 401, "authentication_error"),
    (NotFoundError, 404, "invalid_request_error"),
    (ConflictError, 409, "invalid_request_error"),
    (RequestTooLargeError, 413, "invalid_request_error"),
    (RateLimitError, 429, "rate_limit_error"),
    (EngineUnavailableError, 503, "service_unavailable"),
    (InternalError, 500, "internal_error"),
]


def status_of(exc: APIError) -> tuple[int, str]:
    """HTTP status and OpenAI error type for ``exc``."""
    for cls, status, err_type in _STATUS:
        if isinstance(exc, cls):
            return status, err_type
    return 500, "internal_error"


def error_body(exc: APIError) -> dict[str, Any]:
    """The OpenAI error object for ``exc`` (also used as an SSE error event)."""
    _, err_type = status_of(exc)
    message, param = _utf8_safe(exc.message), _utf8_safe(exc.param)
    return {"error": {"message": message, "type": err_type, "param": param, "code": exc.code}}


def _utf8_safe(text: str | None) -> str | None:
    """``text`` with lone surrogates (echoed from bad input) escaped, so the body can be encoded."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(exc: APIError) -> JSONResponse:
    status, _ = status_of(exc)
    return JSONResponse(error_body(exc), status_code=status, headers=exc.headers)


_PARAM_RE = re.compile(r"invalid value for '([A-Za-z_]+)'")


def from_value_error(exc: ValueError, rename: dict[str, str] | None = None) -> InvalidRequestError:
    """Turn a ``SamplingParams.validate`` / engine ``ValueError`` into a 400 naming the field."""
    message = str(exc)
    m = _PARAM_RE.search(message)
    param = m.group(1) if m else None
    if param and rename:
        param = rename.get(param, param)
    return InvalidRequestError(message, param=param)


def _validation_error(exc: RequestValidationError) -> InvalidRequestError:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = errors[0].get("ctx", {}).get("error", "malformed JSON")
        return InvalidRequestError(f"The request body is not valid JSON: {detail}", code="invalid_json")
    if len(errors) == 1 and tuple(errors[0].get("loc", ())) == ("body",):
        return InvalidRequestError(
            "The request body must be a JSON object (sent with 'Content-Type: application/json').",
            code="invalid_body",
        )
    locs = [[str(p) for p in e.get("loc", ()) if p != "body"] for e in errors]
    parts = [f"{'.'.join(loc) or 'body'}: {e.get('msg', 'invalid value')}" for loc, e in zip(locs, errors)]
    return InvalidRequestError("Invalid request: " + "; ".join(parts[:5]), param=_common_path(locs))


def _common_path(locs: list[list[str]]) -> str | None:
    """The field all errors are about; several errors under one field come from a union's members."""
    if len(locs) == 1:
        return ".".join(locs[0]) or None
    prefix: list[str] = []
    for parts in zip(*locs):
        if len(set(parts)) > 1:
            break
        prefix.append(parts[0])
    return ".".join(prefix or locs[0]) or None


def _http_error(exc: StarletteHTTPException) -> APIError:
    message = str(exc.detail)
    if exc.status_code == 404:
        return NotFoundError(message)
    if exc.status_code == 401:
        return AuthenticationError(message)
    if exc.status_code == 413:
        return RequestTooLargeError(message)
    return InvalidRequestError(message, code="method_not_allowed" if exc.status_code == 405 else None)


def install_error_handlers(app: FastAPI, on_error: Callable[[int], None] | None = None) -> None:
    """Register the handlers; ``on_error(status)`` is called for every error response (metrics)."""

    def respond(exc: APIError, status_override: int | None = None) -> JSONResponse:
        resp = error_response(exc)
        if status_override is not None:
            resp.status_code = status_override
        if on_error is not None:
            on_error(resp.status_code)
        return resp

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return respond(exc)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code if 400 <= exc.status_code < 500 else None
        return respond(_http_error(exc), status_override=status)

    @app.exception_handler(Exception)
    async def _unhandled(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return respond(InternalError("Internal server error."))
