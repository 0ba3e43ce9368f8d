"""``GET /v1/admin/instances``: every engine instance with its role, health and load.

Works in both modes: over an ``InstancePool`` (cluster) it lists the registry; over a single
``EngineClient`` it shows that one engine as instance ``local`` (role ``mixed``). With dynamic PD it
also shows the pools, each instance's pool and predictors, and the flips with their reasons; and
``POST /v1/admin/instances/{name}/role`` flips an instance by hand (``{"role": "prefill" | "decode"}``).
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import APIRouter, Depends

from xservice.http.errors import ConflictError, InvalidRequestError, NotFoundError
from xservice.protocol.base import APIRequest
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


class FlipRequest(APIRequest):
    role: str
    reason: str = ""


@router.post("/v1/admin/instances/{name}/role")
async def admin_flip(name: str, body: FlipRequest, ctx: ServingContext = Depends(get_ctx)) -> dict[str, Any]:
    dynamic = getattr(ctx.engine_client, "dynamic", None)
    if dynamic is None:
        raise InvalidRequestError("Roles flip only with dynamic PD (cluster.pd.mode: dynamic).", param="role")
    if body.role not in ("prefill", "decode"):
        raise InvalidRequestError("'role' must be 'prefill' or 'decode'.", param="role")
    try:
        flip = dynamic.manual_flip(name, body.role, body.reason)
    except KeyError:
        raise NotFoundError(f"No healthy instance named {name!r}.") from None
    except ValueError as e:
        raise ConflictError(str(e)) from None
    return {"instance": flip.name, "role": flip.to_role, "reason": flip.reason, "pools": dynamic.pools()}
