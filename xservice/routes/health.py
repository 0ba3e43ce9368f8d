"""Health probes (no API key needed; ``docs/operations.md`` maps them onto Kubernetes probes).

- ``GET /health``: 200 when an engine can serve requests now, else 503 (``status`` says whether a
  supervisor is restarting one or gave up). What a load balancer should check.
- ``GET /health/live`` (liveness): 200 while the service works and its engines are serving or being
  restarted; 503 once the supervisor gave up on every engine, so an orchestrator replaces the pod.
- ``GET /health/ready`` (readiness): 200 when an engine answers a ping within 2 s, else 503.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends

from xservice.errors import EngineUnavailableError
from xservice.serving.context import ServingContext, get_ctx

router = APIRouter()

READY_TIMEOUT_S = 2.0


@router.get("/health")
async def health(ctx: ServingContext = Depends(get_ctx)) -> dict[str, str]:
    state = ctx.engine_client.health
    if state != "ok":
        raise EngineUnavailableError(_message(state), code=f"engine_{state}")
    return {"status": "ok"}


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
