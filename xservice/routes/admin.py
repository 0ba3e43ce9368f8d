"""``GET /v1/admin/stats``: the engine's counters (free blocks, queue lengths) and its pid; in cluster
mode the counters summed over the instances, and each instance's own under ``instances``."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import APIRouter, Depends

from xservice.http.errors import EngineUnavailableError
from xservice.routes.error_responses import errors
from xservice.serving.context import ServingContext, get_ctx

router = APIRouter()

STATS_TIMEOUT_S = 5.0


@router.get("/v1/admin/stats", responses=errors(503))
async def admin_stats(ctx: ServingContext = Depends(get_ctx)) -> dict[str, Any]:
    client = ctx.engine_client
    ctx.check_engine()
    try:
        stats = await client.stats(timeout_s=STATS_TIMEOUT_S)
    except Exception as exc:  # dead or not answering: both mean "unavailable" to the caller
        raise EngineUnavailableError(f"Engine stats unavailable: {type(exc).__name__}: {exc}") from None
    out = {**msgspec.to_builtins(stats), "engine_pid": client.pid, "num_inflight": ctx.num_inflight}
    per_instance = getattr(client, "instance_stats", None)  # cluster mode: each instance's own counters
    if per_instance:
        out["instances"] = {name: msgspec.to_builtins(s) for name, s in sorted(per_instance.items())}
    return out
