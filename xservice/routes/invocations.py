"""``POST /invocations`` (vLLM's, for SageMaker-style hosting): one route for every generation API.

The body's shape picks the API, as vLLM does: ``messages`` → chat completions, ``prompt`` →
completions, ``input`` → embeddings (none of them: chat completions, whose 400 then names what is
missing or unknown). The body is then validated and served exactly as on that route
(same field rule, same answers), so ``/invocations`` adds no behaviour of its own.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from xservice.protocol import ChatCompletionRequest, CompletionRequest
from xservice.protocol.embeddings import EmbeddingRequest
from xservice.serving.chat import create_chat_completion
from xservice.serving.completions import create_completion
from xservice.serving.context import ServingContext, get_ctx
from xservice.serving.embeddings import create_embeddings

router = APIRouter()

# body key -> (request model, handler), first match wins
_APIS = (
    ("messages", ChatCompletionRequest, create_chat_completion),
    ("prompt", CompletionRequest, create_completion),
    ("input", EmbeddingRequest, create_embeddings),
)


@router.post("/invocations")
async def invocations(
    request: Request, body: dict[str, Any] = Body(...), ctx: ServingContext = Depends(get_ctx)
) -> Response:
    key, model, handler = next((api for api in _APIS if api[0] in body), _APIS[0])  # else: chat's 400s
    return await handler(ctx, _validate(model, body), request)


def _validate(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:  # the same 400 the API's own route gives
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
