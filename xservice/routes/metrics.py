"""``GET /metrics``: Prometheus text format, engine gauges refreshed on each scrape."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from xservice.http.metrics import CONTENT_TYPE
from xservice.serving.context import ServingContext, get_ctx

router = APIRouter()
logger = logging.getLogger(__name__)

STATS_TIMEOUT_S = 1.0


@router.get(
    "/metrics",
    response_class=Response,  # no JSON: the 200 is documented as what it is, Prometheus text
    responses={
        200: {
            "description": "Prometheus text format.",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    },
)
async def metrics(ctx: ServingContext = Depends(get_ctx)) -> Response:
    try:
        ctx.metrics.update_engine(await ctx.engine_client.stats(timeout_s=STATS_TIMEOUT_S))
    except Exception:  # engine slow or gone: keep serving the last known values
        logger.debug("engine stats unavailable for /metrics", exc_info=True)
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)
