"""``build_app()``: the OpenAI-compatible FastAPI application over one engine client.

Torch-free: importing this module must never import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI

from xservice.auth import ApiKeyMiddleware
from xservice.config import XllmConfig
from xservice.errors import install_error_handlers
from xservice.metrics import ServiceMetrics
from xservice.routes import admin, chat, completions, health, metrics, models, tokenize
from xservice.serving.body_limit import BodyLimitMiddleware
from xservice.serving.context import ServingContext

if TYPE_CHECKING:
    from xengine.text.tokenizer import Tokenizer
    from xservice.engine_client import EngineClient

ROUTERS = (
    health.router,
    models.router,
    completions.router,
    chat.router,
    tokenize.router,
    metrics.router,
    admin.router,
)


def build_app(engine_client: EngineClient, tokenizer: Tokenizer, config: XllmConfig) -> FastAPI:
    """The HTTP app serving ``engine_client`` with ``tokenizer`` (the served model's).

    The app does not own the engine client: whoever created it closes it.
    """
    app = FastAPI(title="xllm", docs_url=None, redoc_url=None)
    service_metrics = ServiceMetrics()
    app.state.ctx = ServingContext(
        engine_client=engine_client, tokenizer=tokenizer, config=config, metrics=service_metrics
    )
    install_error_handlers(app, on_error=service_metrics.record_error)
    for router in ROUTERS:
        app.include_router(router)
    # add_middleware wraps: the last added runs first. Auth, then the body bound, then routing.
    app.add_middleware(
        BodyLimitMiddleware,
        max_body_bytes=config.service.max_body_bytes,
        on_error=service_metrics.record_error,
    )
    if config.service.api_key:
        app.add_middleware(
            ApiKeyMiddleware, api_key=config.service.api_key, on_error=service_metrics.record_error
        )
    return app
