"""``GET /health`` (the process is up) and ``GET /health/ready`` (the engine answers)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from xservice.errors import EngineUnavailableError
from xservice.serving.context import ServingContext, get_ctx

router = APIRouter()

READY_TIMEOUT_S = 2.0


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/health/ready")
async def ready(ctx: ServingContext = Depends(get_ctx)) -> dict[str, str]:
    client = ctx.engine_client
    if not client.is_alive or not await client.ping(timeout_s=READY_TIMEOUT_S):
        raise EngineUnavailableError("The engine is not answering.")
    return {"status": "ready"}
