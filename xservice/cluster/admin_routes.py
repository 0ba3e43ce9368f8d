"""``GET /v1/admin/instances``: every engine instance with its role, health and load.

Works in both modes: over an ``InstancePool`` (cluster) it lists the registry; over a single
``EngineClient`` it shows that one engine as instance ``local`` (role ``mixed``).
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import APIRouter, Depends

from xservice.serving.context import ServingContext, get_ctx

router = APIRouter()

STATS_TIMEOUT_S = 2.0


@router.get("/v1/admin/instances")
async def admin_instances(ctx: ServingContext = Depends(get_ctx)) -> dict[str, Any]:
    client = ctx.engine_client
    if hasattr(client, "instances_view"):
        return {**client.cluster_view(), "instances": await client.instances_view()}
    load = None
    if client.is_alive:
        try:
            load = msgspec.to_builtins(await client.stats(timeout_s=STATS_TIMEOUT_S))
        except Exception:  # noqa: BLE001 - shown as unhealthy below
            load = None
    instance = {
        "name": "local",
        "role": "mixed",
        "healthy": bool(client.is_alive and load is not None),
        "pid": client.pid,
        "load": load,
        "num_inflight": client.num_inflight,
    }
    return {"mode": "single", "instances": [instance]}
