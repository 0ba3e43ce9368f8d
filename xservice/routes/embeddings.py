"""``POST /v1/embeddings``."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from xservice.protocol.embeddings import EmbeddingRequest, EmbeddingResponse
from xservice.routes.body_route import BodyRoute
from xservice.routes.error_responses import GENERATION_ERRORS, errors
from xservice.serving.context import ServingContext, get_ctx
from xservice.serving.embeddings import create_embeddings

router = APIRouter(route_class=BodyRoute)


@router.post("/v1/embeddings", responses={200: {"model": EmbeddingResponse}, **errors(*GENERATION_ERRORS)})
async def embeddings(
    body: EmbeddingRequest, request: Request, ctx: ServingContext = Depends(get_ctx)
) -> Response:
    return await create_embeddings(ctx, body, request)
