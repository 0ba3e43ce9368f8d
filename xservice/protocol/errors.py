"""OpenAI's error object, the body of every error response (and of an error event in a stream)."""

from __future__ import annotations

from xservice.protocol.base import APIResponse


class ErrorDetail(APIResponse):
    message: str
    type: str  # e.g. invalid_request_error, authentication_error, rate_limit_error, service_unavailable
    param: str | None  # the request field the error is about, when there is one
    code: str | None  # a machine-readable reason, e.g. context_length_exceeded, model_not_found


class ErrorResponse(APIResponse):
    """OpenAI's error object: every error response of the API has this body."""

    error: ErrorDetail
