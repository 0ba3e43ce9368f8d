"""``GET /v1/models`` and ``GET /v1/models/{model_id}``: the served model's card and its LoRA adapters
(``parent``: the base model, as vLLM)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from xservice.http.errors import ModelNotFoundError
from xservice.protocol import ModelCard, ModelList
from xservice.routes.error_responses import errors
from xservice.serving.context import ServingContext, get_ctx

router = APIRouter()


def _card(ctx: ServingContext) -> ModelCard:
    return ModelCard(id=ctx.model_name, root=ctx.config.model.model or None, max_model_len=ctx.max_model_len)


def _adapter_cards(ctx: ServingContext) -> list[ModelCard]:
    return [ModelCard(id=name, root=path, parent=ctx.model_name) for name, path in ctx.loras.adapters.items()]


@router.get("/v1/models", response_model=ModelList)
async def list_models(ctx: ServingContext = Depends(get_ctx)) -> ModelList:
    return ModelList(data=[_card(ctx), *_adapter_cards(ctx)])


# ``:path``: served names often contain a slash ("Qwen/Qwen3-0.6B"), as in OpenAI's fine-tuned ids.
@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=errors(404))
async def retrieve_model(model_id: str, ctx: ServingContext = Depends(get_ctx)) -> ModelCard:
    if model_id == ctx.model_name:
        return _card(ctx)
    card = next((c for c in _adapter_cards(ctx) if c.id == model_id), None)
    if card is None:
        raise ModelNotFoundError(f"The model '{model_id}' does not exist.", param="model")
    return card
