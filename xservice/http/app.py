"""``build_app()``: the OpenAI-compatible FastAPI application over an engine backend.

Torch-free: importing this module must never import torch.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI

from xservice.batch.service import BatchService, batch_lifespan
from xservice.cluster import admin_routes as cluster_admin
from xservice.config import XllmConfig
from xservice.http.auth import OPEN_PATHS, ApiKeyMiddleware
from xservice.http.errors import install_error_handlers
from xservice.http.metrics import ServiceMetrics
from xservice.routes import (
    admin,
    batches,
    chat,
    chat_batch,
    completions,
    embeddings,
    files,
    health,
    invocations,
    lora,
    metrics,
    models,
    rec,
    responses,
    server_info,
    tokenize,
    version,
)
from xservice.routes.error_responses import common_errors, declare_errors, drop_validation_422
from xservice.serving.body_limit import BodyLimitMiddleware
from xservice.serving.context import ServingContext

if TYPE_CHECKING:
    from xengine.api.text.tokenizer import Tokenizer
    from xservice.engine.protocol import EngineBackend

MULTIPART_OVERHEAD_BYTES = 64 * 1024  # form fields and part headers around an uploaded file

ROUTERS = (
    health.router,
    version.router,
    models.router,
    lora.router,
    completions.router,
    chat.router,
    chat_batch.router,
    responses.router,
    embeddings.router,
    invocations.router,
    tokenize.router,
    server_info.router,
    metrics.router,
    admin.router,
    files.router,
    batches.router,
    rec.router,
    cluster_admin.router,
)

# The errors (beyond the common ones) of routes whose modules do not declare theirs in the decorator
# (the other routers use ``error_responses.errors``); /openapi.json documents them.
OTHER_ROUTE_ERRORS: dict[str, tuple[int, ...]] = {
    "GET /health": (503,),
    "GET /health/live": (503,),
    "GET /health/ready": (503,),
    "POST /v1/files": (409, 503),
    "GET /v1/files": (503,),
    "GET /v1/files/{file_id}": (404, 503),
    "DELETE /v1/files/{file_id}": (404, 503),
    "GET /v1/files/{file_id}/content": (404, 503),
    "POST /v1/batches": (404, 503),
    "GET /v1/batches": (503,),
    "GET /v1/batches/{batch_id}": (404, 503),
    "POST /v1/batches/{batch_id}/cancel": (404, 503),
    "POST /v1/admin/instances/{name}/role": (404, 409),
}


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Batch runner up while serving; at shutdown, also stop the tokenizer workers."""
    try:
        async with batch_lifespan(app):
            yield
    finally:
        app.state.ctx.close()


def _max_model_len(engine_client: EngineBackend) -> int | None:
    try:
        return engine_client.info.max_model_len
    except Exception:  # no engine registered yet (cluster mode): the histograms get default buckets
        return None


def build_app(engine_client: EngineBackend, tokenizer: Tokenizer, config: XllmConfig) -> FastAPI:
    """The HTTP app serving ``engine_client`` (a single engine, a supervised one or the cluster's pool)
    with ``tokenizer`` (the served model's).

    The app does not own the engine client: whoever created it closes it.
    """
    app = FastAPI(title="xllm", docs_url=None, redoc_url=None, lifespan=_lifespan)
    service_metrics = ServiceMetrics(max_model_len=_max_model_len(engine_client))
    service_metrics.watch_engine(engine_client)
    app.state.ctx = ServingContext(
        engine_client=engine_client, tokenizer=tokenizer, config=config, metrics=service_metrics
    )
    service_metrics.model_name = app.state.ctx.model_name
    app.state.batch = BatchService(app.state.ctx, config.batch)
    install_error_handlers(app, on_error=service_metrics.record_error)
    for router in ROUTERS:
        declare_errors(router, OTHER_ROUTE_ERRORS)
        open_ = all(getattr(route, "path", None) in OPEN_PATHS for route in router.routes)  # the probes
        app.include_router(router, responses=common_errors(bool(config.service.api_key) and not open_))
    drop_validation_422(app)
    # add_middleware wraps: the last added runs first. Auth, then the body bound, then routing.
    app.add_middleware(
        BodyLimitMiddleware,
        max_body_bytes=config.service.max_body_bytes,
        path_limits={"/v1/files": config.batch.max_file_bytes + MULTIPART_OVERHEAD_BYTES},
        on_error=service_metrics.record_error,
    )
    if config.service.api_key:
        app.add_middleware(
            ApiKeyMiddleware, api_key=config.service.api_key, on_error=service_metrics.record_error
        )
    return app
