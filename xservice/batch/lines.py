"""Batch lines: parse input lines, run one through the online serving path, build output records.

A runnable line's ``body`` is validated and served by the same functions as an HTTP request to
its endpoint (``create_completion`` / ``create_chat_completion`` / ``create_embeddings``), with
``priority="offline"`` and ``stream=false`` forced. Output records follow OpenAI's batch output format.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterable, Iterator
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from xservice.batch.store import IngestedLine, new_id
from xservice.http.errors import (
    APIError,
    EngineUnavailableError,
    InternalError,
    RateLimitError,
    _validation_error,
    error_body,
    status_of,
)
from xservice.protocol import ChatCompletionRequest, CompletionRequest
from xservice.protocol.embeddings import EmbeddingRequest
from xservice.protocol.request_model import find_unsafe_value
from xservice.serving.chat import create_chat_completion
from xservice.serving.completions import create_completion
from xservice.serving.context import ServingContext, new_request_id
from xservice.serving.embeddings import create_embeddings

logger = logging.getLogger(__name__)

ENDPOINTS: dict[str, tuple[type[BaseModel], Any]] = {
    "/v1/chat/completions": (ChatCompletionRequest, create_chat_completion),
    "/v1/completions": (CompletionRequest, create_completion),
    "/v1/embeddings": (EmbeddingRequest, create_embeddings),
}


MAX_FILE_ERRORS = 10  # entries in a failed batch's ``errors``


class RetryLater(Exception):
    """The line could not run now (engine unavailable, too many requests); it stays pending.

    ``engine_stopped``: an engine that was serving when the line was sent died under it (a crash or
    a hang the supervisor killed), so the line may be what killed it; else it never ran.
    """

    def __init__(self, message: str, engine_stopped: bool = False) -> None:
        super().__init__(message)
        self.engine_stopped = engine_stopped


# ---------------------------------------------------------------------- output records


def success_record(custom_id: str, status_code: int, body: dict[str, Any]) -> dict[str, Any]:
    request_id = body.get("id") or new_request_id("req")
    return {
        "id": new_id("batch_req_"),
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": request_id, "body": body},
        "error": None,
    }


def error_record(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    """A line that never reached the endpoint (malformed, wrong url, cancelled, ...)."""
    return {
        "id": new_id("batch_req_"),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


def api_error_record(custom_id: str, exc: APIError) -> dict[str, Any]:
    """A line the endpoint refused: the HTTP error response, plus its code and message."""
    status, _ = status_of(exc)
    return {
        "id": new_id("batch_req_"),
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": new_request_id("req"), "body": error_body(exc)},
        "error": {"code": exc.code or "invalid_request", "message": exc.message},
    }


# ---------------------------------------------------------------------- parsing


class InputFileError(Exception):
    """The input file as a whole is not JSONL: the batch fails with ``errors`` (OpenAI's entries)."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__(errors[0]["message"])
        self.errors = errors


def _file_error(code: str, message: str, line: int) -> dict[str, Any]:
    return {"code": code, "message": message, "param": "input_file_id", "line": line}


def parse_lines(raw_lines: Iterable[bytes], endpoint: str | None) -> Iterator[IngestedLine]:
    """Number the non-blank lines of an input file and check each one's envelope.

    A line that cannot run (not JSON, no ``custom_id``, a duplicate ``custom_id``, a ``url`` other
    than ``endpoint`` (``None``: any batch endpoint), a ``method`` other than POST, no ``body``
    object) carries its error record, whose message names the line (1-based, blank lines counted).
    Raises ``InputFileError`` for a file that is not JSONL at all: a line that is not UTF-8 text
    (a binary file), or no line that is a JSON object.
    """
    seen: set[str] = set()
    line_no = 0
    num_objects = 0
    json_errors: list[dict[str, Any]] = []
    for number, raw in enumerate(raw_lines, start=1):
        if b"\0" in raw or not _is_utf8(raw):
            message = (
                f"Line {number} is not UTF-8 text; the input file must be JSONL (one JSON object per line)."
            )
            raise InputFileError([_file_error("invalid_file_format", message, number)])
        if not raw.strip():
            continue
        line = _parse_line(raw, line_no, number, endpoint, seen)
        if line.result is None or line.result["error"]["code"] != "invalid_json_line":
            num_objects += 1  # the file is JSONL: its bad lines fail one by one
        elif len(json_errors) < MAX_FILE_ERRORS:
            json_errors.append(_file_error("invalid_json_line", line.result["error"]["message"], number))
        yield line
        line_no += 1
    if num_objects == 0 and json_errors:
        raise InputFileError(json_errors)


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def check_upload(data: bytes, max_errors: int = MAX_FILE_ERRORS) -> list[str]:
    """The first ``max_errors`` problems of a ``purpose=batch`` upload, each naming its line.

    Every line must be a JSON object with a unique ``custom_id``, ``method`` POST, a batch
    endpoint as ``url`` and a ``body`` object (the checks a batch makes, without its endpoint).
    """
    problems: list[str] = []
    try:
        for line in parse_lines(io.BytesIO(data), None):
            if line.result is not None:
                problems.append(line.result["error"]["message"])
                if len(problems) >= max_errors:
                    break
    except InputFileError as e:  # a binary line (no JSON object at all: those lines are listed)
        problems += [error["message"] for error in e.errors if error["code"] == "invalid_file_format"]
    return problems[:max_errors]


def _parse_line(raw: bytes, line_no: int, number: int, endpoint: str | None, seen: set[str]) -> IngestedLine:
    def bad(code: str, message: str, custom_id: str | None = None) -> IngestedLine:
        where = f"Line {number}: "
        return IngestedLine(line_no, custom_id, result=error_record(custom_id, code, where + message))

    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        return bad("invalid_json_line", f"not valid JSON ({e}).")
    except RecursionError:
        return bad("invalid_json_line", "not valid JSON (nested too deeply).")
    if not isinstance(obj, dict):
        return bad("invalid_json_line", "must be a JSON object.")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return bad("missing_custom_id", "'custom_id' must be a non-empty string.")
    if find_unsafe_value(custom_id) is not None:  # a lone surrogate: not storable as text
        return bad("invalid_custom_id", "'custom_id' must be valid Unicode text.")
    if custom_id in seen:
        return bad("duplicate_custom_id", f"'custom_id' {custom_id!r} appears more than once.", custom_id)
    seen.add(custom_id)
    method = obj.get("method", "POST")
    if method != "POST":
        return bad("invalid_method", f"'method' must be 'POST', got {method!r}.", custom_id)
    url = obj.get("url")
    if endpoint is None and (not isinstance(url, str) or url not in ENDPOINTS):
        return bad("invalid_url", f"'url' must be one of {sorted(ENDPOINTS)}, got {url!r}.", custom_id)
    if endpoint is not None and url != endpoint:
        return bad(
            "mismatched_url", f"'url' must be the batch endpoint {endpoint!r}, got {url!r}.", custom_id
        )
    body = obj.get("body")
    if not isinstance(body, dict):
        return bad("invalid_body", "'body' must be a JSON object.", custom_id)
    return IngestedLine(line_no, custom_id, body=body)


# ---------------------------------------------------------------------- running


class _NoClient:
    """Stands in for the HTTP request: a batch line's "client" never disconnects."""

    async def receive(self) -> dict[str, Any]:
        await asyncio.get_running_loop().create_future()
        raise AssertionError("unreachable")


async def run_line(
    ctx: ServingContext, endpoint: str, custom_id: str, body: dict[str, Any]
) -> dict[str, Any]:
    """Serve one line's ``body`` like a request to ``endpoint``; returns its output record.

    Raises ``RetryLater`` when the service cannot take it now; cancelling aborts the engine request.
    """
    model_cls, handler = ENDPOINTS[endpoint]
    serving = ctx.engine_client.health == "ok"  # else a failure below is no sign against the line
    try:
        try:
            request = model_cls.model_validate(body)
        except ValidationError as e:
            raise _validation_error(RequestValidationError(e.errors())) from None
        forced = {"priority": "offline", "stream": False}  # (embeddings have no "stream")
        request = request.model_copy(update={k: v for k, v in forced.items() if k in model_cls.model_fields})
        response = await handler(ctx, request, _NoClient())
    except RateLimitError as exc:
        raise RetryLater(exc.message) from None
    except EngineUnavailableError as exc:
        raise RetryLater(exc.message, engine_stopped=serving) from None
    except APIError as exc:
        return api_error_record(custom_id, exc)
    except Exception:
        logger.exception("batch line %r failed", custom_id)
        return api_error_record(custom_id, InternalError("Internal server error."))
    return success_record(custom_id, response.status_code, json.loads(response.body))


def is_error_record(record: dict[str, Any]) -> bool:
    response = record.get("response")
    return record.get("error") is not None or response is None or response.get("status_code") != 200
