"""Health probes (no API key needed; ``docs/operations.md`` maps them onto Kubernetes probes).

- ``GET /health``: 200 when an engine can serve requests now and answers a ping, else 503 (``code``
  says whether a supervisor is restarting one, gave up, or the engine does not answer). What a load
  balancer should check. Pings are cached for ``PING_CACHE_S`` and a probe waits at most
  ``PING_WAIT_S`` for a fresh one, so probes stay cheap and never stall on a frozen engine. The body
  carries ``batch_runner`` while the batch runner is degraded (its job store keeps failing).
- ``GET /health/live`` (liveness): 200 while the service works and its engines are serving or being
  restarted; 503 once the supervisor gave up on every engine, so an orchestrator replaces the pod.
- ``GET /health/ready`` (readiness): 200 when an engine answers a ping within 2 s, else 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request

from xservice.http.errors import EngineUnavailableError
from xservice.serving.context import ServingContext, get_ctx

if TYPE_CHECKING:
    from xservice.engine.protocol import EngineBackend

router = APIRouter()
logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 2.0
PING_CACHE_S = 1.0  # a ping answer is reused this long
PING_WAIT_S = 0.5  # longest a /health probe waits for a ping; slower: the last answer stands


class EngineProbe:
    """The engine's last ping answer, refreshed by at most one ping at a time when it is stale.

    A frozen engine (SIGSTOP, a VM pause) turns the answer to "not answering" once a ping times out
    (``READY_TIMEOUT_S``), and back at the first ping it answers.
    """

    def __init__(self, client: EngineBackend) -> None:
        self.client = client
        self.answering = True  # the service starts once its engine is ready
        self._checked_at = float("-inf")
        self._ping: asyncio.Task[None] | None = None

    async def check(self) -> bool:
        if time.monotonic() - self._checked_at >= PING_CACHE_S:
            if self._ping is None or self._ping.done():
                self._ping = asyncio.ensure_future(self._refresh())
            await asyncio.wait({self._ping}, timeout=PING_WAIT_S)  # the ping goes on if it is slower
        return self.answering

    async def _refresh(self) -> None:
        try:
            self.answering = await self.client.ping(timeout_s=READY_TIMEOUT_S)
        except Exception:  # a client that cannot ping (a bug, not an answer): keep the last answer
            logger.warning("/health: the engine ping failed", exc_info=True)
        self._checked_at = time.monotonic()


def _probe(request: Request, ctx: ServingContext) -> EngineProbe:
    probe = getattr(request.app.state, "engine_probe", None)
    if probe is None:
        probe = request.app.state.engine_probe = EngineProbe(ctx.engine_client)
    return probe


@router.get("/health")
async def health(request: Request, ctx: ServingContext = Depends(get_ctx)) -> dict[str, Any]:
    state = ctx.engine_client.health
    if state != "ok":
        raise EngineUnavailableError(_message(state), code=f"engine_{state}")
    if not await _probe(request, ctx).check():
        raise EngineUnavailableError(
            f"The engine is not answering (no reply to a ping within {READY_TIMEOUT_S:g} s).",
            code="engine_not_answering",
        )
    body: dict[str, Any] = {"status": "ok"}
    batch = getattr(request.app.state, "batch", None)
    runner = batch.runner_state() if batch is not None else None
    if runner is not None and not runner.healthy:
        body["batch_runner"] = {
            "status": "degraded",
            "last_error": runner.last_error,
            "degraded_since": runner.degraded_since,
        }
    return body


@router.get("/health/live")
async def live(ctx: ServingContext = Depends(get_ctx)) -> dict[str, str]:
    state = ctx.engine_client.health
    if state == "failed":
        raise EngineUnavailableError(_message(state), code="engine_failed")
    return {"status": "ok" if state == "ok" else state}


@router.get("/health/ready")
async def ready(ctx: ServingContext = Depends(get_ctx)) -> dict[str, str]:
    client = ctx.engine_client
    if not client.is_alive or not await client.ping(timeout_s=READY_TIMEOUT_S):
        raise EngineUnavailableError("The engine is not answering.")
    return {"status": "ready"}


def _message(state: str) -> str:
    if state == "restarting":
        return "No engine can serve right now: the supervisor is restarting it; retry shortly."
    return "No engine can serve and none is being restarted (the supervisor gave up); see the service log."
