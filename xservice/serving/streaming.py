"""Server-sent events, merged multi-prompt streams and disconnect-aware non-streaming runs."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from xservice.http.errors import APIError, InternalError, error_body, status_of
from xservice.http.metrics import ServiceMetrics
from xservice.serving.context import Ticket

logger = logging.getLogger(__name__)

T = TypeVar("T")
DONE = "data: [DONE]\n\n"
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"; nobody reads it


def sse(payload: dict[str, Any], event: str | None = None) -> str:
    """One SSE event carrying ``payload`` as JSON (with an ``event:`` name line when ``event`` is given)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _error_event(exc: APIError, named: bool) -> str:
    body = error_body(exc)
    return sse({"type": "error", **body["error"]}, "error") if named else sse(body)


Event = dict[str, Any] | str  # a payload to encode, or an SSE event already encoded (``sse_chunks.py``)


async def _sse_events(
    events: AsyncIterator[Event], metrics: ServiceMetrics, named: bool = False
) -> AsyncIterator[str]:
    """Events, then ``[DONE]``; an error mid-stream becomes one ``{"error": ...}`` event first.

    ``named`` (the Responses API): each event also carries its ``type`` as the SSE event name, an
    error is a ``{"type": "error", ...}`` event, and no ``[DONE]`` follows.
    """
    try:
        async for event in events:
            if isinstance(event, str):
                yield event
            else:
                yield sse(event, event.get("type") if named else None)
    except APIError as exc:
        metrics.record_error(status_of(exc)[0])
        yield _error_event(exc, named)
    except Exception:
        logger.exception("error while streaming a response")
        metrics.record_error(500)
        yield _error_event(InternalError("Internal server error while streaming."), named)
    if not named:
        yield DONE


def sse_response(
    events: AsyncIterator[Event], ticket: Ticket, metrics: ServiceMetrics, *, named: bool = False
) -> StreamingResponse:
    """A ``text/event-stream`` response of ``events`` (payload dicts, or events already encoded as
    ``sse()`` would); ``ticket`` is released when the stream ends, however it ends.

    On client disconnect Starlette cancels the iteration (ASGI spec < 2.4) and the cancellation
    reaches ``Generation.stream``, which aborts the engine request.
    """

    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in _sse_events(events, metrics, named):
                yield chunk
        finally:
            ticket.release()
            await events.aclose()  # type: ignore[attr-defined]

    chunks = body()

    async def cleanup() -> None:
        # Runs after the response however it ended; closes a body left suspended at a ``yield``
        # when the send was cancelled, and releases the ticket if the body never started.
        ticket.release()
        await chunks.aclose()

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(
        chunks, media_type="text/event-stream", headers=headers, background=BackgroundTask(cleanup)
    )


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as items arrive, tagging each with its stream's position.

    The first exception from any stream is re-raised; leaving early cancels the others.
    """
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None, bool]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item, None, False))
        except Exception as exc:
            await queue.put((i, None, exc, True))
            return
        await queue.put((i, None, None, True))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, exc, done = await queue.get()
            if exc is not None:
                raise exc
            if done:
                remaining -= 1
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it (and so aborting its engine requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


def disconnected_response() -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)
