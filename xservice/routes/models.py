"""``GET /v1/models`` and ``GET /v1/models/{model_id}``: the served model's card."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from xservice.http.errors import ModelNotFoundError
from xservice.protocol import ModelCard, ModelList
from xservice.routes.error_responses import errors
from xservice.serving.context import ServingContext, get_ctx

router = APIRouter()


def _card(ctx: ServingContext) -> ModelCard:
    return ModelCard(id=ctx.model_name, root=ctx.config.model.model or None, max_model_len=ctx.max_model_len)


@router.get("/v1/models", response_model=ModelList)
async def list_models(ctx: ServingContext = Depends(get_ctx)) -> ModelList:
    return ModelList(data=[_card(ctx)])


# ``:path``: served names often contain a slash ("Qwen/Qwen3-0.6B"), as in OpenAI's fine-tuned ids.
@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=errors(404))
async def retrieve_model(model_id: str, ctx: ServingContext = Depends(get_ctx)) -> ModelCard:
    if model_id != ctx.model_name:
        raise ModelNotFoundError(f"The model '{model_id}' does not exist.", param="model")
    return _card(ctx)
