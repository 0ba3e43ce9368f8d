"""JSON request bodies decoded, counted and validated off the event loop when they are large.

FastAPI decodes and validates a declared body on the event loop, and a multi-megabyte body of many
small parts (pydantic runs the field rule of ``xservice/protocol/request_model.py`` once per part)
holds the loop long enough to stall every stream on the server. ``BodyParser.parse`` does the same
work on a small thread pool for bodies above ``INLINE_MAX_BYTES``, after the cheap counts of
``request_limits`` (which refuse such a body before any validation):

- ``json.loads`` and pydantic's core hold the GIL in C; the decoder calls back into Python after each
  object and the field rule is Python, so the loop gets the GIL back every switch interval, except
  inside one large array or object of scalars (bounded by the body size);
- one worker thread: parses run one at a time, so the loop competes for the GIL with one of them at
  most (the others wait in the pool's queue, costing the loop nothing), and the GIL is handed back to
  the loop rather than to another parse.

Errors are the ones FastAPI itself raises (``RequestValidationError`` located under ``body``), so a body
parsed here gets the same 400 as one parsed inline. Measurements: ``docs/operations.md``, "Request limits".
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from xservice.http.errors import InvalidRequestError
from xservice.serving.request_limits import RequestLimits, check_counts

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

# Bodies up to this size are parsed inline: ~0.3 us of validation per byte at worst (a body of tiny
# content parts) keeps the loop for at most ~5 ms, about what a hop to a worker costs in latency.
INLINE_MAX_BYTES = 16 * 1024
NUM_WORKERS = 1


class BodyParser:
    """Decodes, counts and validates request bodies; owned by the app (``ServingContext.bodies``)."""

    def __init__(self, limits: RequestLimits, num_workers: int = NUM_WORKERS) -> None:
        self.limits = limits
        self._pool = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="xllm-body")

    async def run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``: inline when ``size`` (bytes of body it works on) is small, else on the pool."""
        if size <= INLINE_MAX_BYTES:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def parse(self, body: bytes, model: type[BaseModel] | None) -> Any:
        """``body`` decoded, counted and (``model`` given) validated into ``model``; 400s as FastAPI's."""
        return await self.run(len(body), self._parse, body, model)

    async def validate(self, model: type[M], data: Any, size: int) -> M:
        """``data`` (decoded JSON of a ``size``-byte body) validated into ``model``; 400s as FastAPI's."""
        return await self.run(size, validate_body, model, data)

    def _parse(self, body: bytes, model: type[BaseModel] | None) -> Any:
        data = decode_body(body)
        try:
            check_counts(data, self.limits)
            return data if model is None else validate_body(model, data)
        except Exception as exc:
            # Free a refused body here, on the worker: the frames of the traceback (and of the pydantic
            # error it replaced) hold it, and freeing 100k objects on the event loop, where the exception
            # is handled, would stall it again.
            exc.__traceback__ = exc.__context__ = exc.__cause__ = None
            del data
            raise

    def close(self) -> None:
        """Stop the workers; queued parses are cancelled."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def decode_body(body: bytes) -> Any:
    """JSON of ``body``; malformed JSON raises FastAPI's own ``json_invalid`` error, text that is not
    UTF-8 (or UTF-16/32) and nesting deeper than the decoder's recursion limit a 400 saying so."""
    try:
        return json.loads(body, object_hook=_yield_point)
    except json.JSONDecodeError as e:
        error = {
            "type": "json_invalid",
            "loc": ("body", e.pos),
            "msg": "JSON decode error",
            "input": {},
            "ctx": {"error": e.msg},
        }
        raise RequestValidationError([error], body=e.doc) from None
    except UnicodeDecodeError as e:
        raise InvalidRequestError(
            f"The request body is not valid JSON: not UTF-8 text ({e.reason} at byte {e.start}).",
            code="invalid_json",
        ) from None
    except RecursionError:
        raise InvalidRequestError(
            "The request body is not valid JSON here: arrays and objects are nested too deeply.",
            code="invalid_json",
        ) from None


def _yield_point(obj: dict[str, Any]) -> dict[str, Any]:
    """Called by the decoder after each object: running Python code lets the GIL go to the event loop
    between objects (the C decoder alone holds it for the whole body: ~30-40 ms per 3 MB of small objects)."""
    return obj


def validate_body(model: type[M], data: Any) -> M:
    """``model.model_validate(data)``; errors raised as FastAPI raises a body's (located under ``body``)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        # without each error's "input" (the refused value, possibly most of the body; no message uses it)
        errors = exc.errors(include_url=False, include_input=False)
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in errors]) from None
