"""``POST /v1/embeddings``."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from xservice.protocol.embeddings import EmbeddingRequest, EmbeddingResponse
from xservice.serving.context import ServingContext, get_ctx
from xservice.serving.embeddings import create_embeddings

router = APIRouter()


@router.post("/v1/embeddings", responses={200: {"model": EmbeddingResponse}})
async def embeddings(
    body: EmbeddingRequest, request: Request, ctx: ServingContext = Depends(get_ctx)
) -> Response:
    return await create_embeddings(ctx, body, request)
