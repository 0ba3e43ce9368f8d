"""``GET /v1/models``: the served model."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from xservice.protocol import ModelCard, ModelList
from xservice.serving.context import ServingContext, get_ctx

router = APIRouter()


@router.get("/v1/models", response_model=ModelList)
async def list_models(ctx: ServingContext = Depends(get_ctx)) -> ModelList:
    card = ModelCard(id=ctx.model_name, root=ctx.config.model.model or None, max_model_len=ctx.max_model_len)
    return ModelList(data=[card])
