"""``build_app()``: the OpenAI-compatible FastAPI application over one engine client.

Torch-free: importing this module must never import torch.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI

from xservice.auth import ApiKeyMiddleware
from xservice.batch.service import BatchService, batch_lifespan
from xservice.cluster import admin_routes as cluster_admin
from xservice.config import XllmConfig
from xservice.errors import install_error_handlers
from xservice.metrics import ServiceMetrics
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
    metrics,
    models,
    rec,
    responses,
    tokenize,
    version,
)
from xservice.serving.body_limit import BodyLimitMiddleware
from xservice.serving.context import ServingContext

if TYPE_CHECKING:
    from xengine.api.text.tokenizer import Tokenizer
    from xservice.engine_client import EngineClient

MULTIPART_OVERHEAD_BYTES = 64 * 1024  # form fields and part headers around an uploaded file

ROUTERS = (
    health.router,
    version.router,
    models.router,
    completions.router,
    chat.router,
    chat_batch.router,
    responses.router,
    embeddings.router,
    invocations.router,
    tokenize.router,
    metrics.router,
    admin.router,
    files.router,
    batches.router,
    rec.router,
    cluster_admin.router,
)


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Batch runner up while serving; at shutdown, also stop the tokenizer workers."""
    try:
        async with batch_lifespan(app):
            yield
    finally:
        app.state.ctx.close()


def _max_model_len(engine_client: EngineClient) -> int | None:
    try:
        return engine_client.info.max_model_len
    except Exception:  # no engine registered yet (cluster mode): the histograms get default buckets
        return None


def build_app(engine_client: EngineClient, tokenizer: Tokenizer, config: XllmConfig) -> FastAPI:
    """The HTTP app serving ``engine_client`` with ``tokenizer`` (the served model's).

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
        app.include_router(router)
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
