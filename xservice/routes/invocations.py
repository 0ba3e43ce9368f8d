"""``POST /invocations`` (vLLM's, for SageMaker-style hosting): one route for every generation API.

The body's shape picks the API, as vLLM does: ``messages`` → chat completions, ``prompt`` →
completions, ``input`` → embeddings (none of them: chat completions, whose 400 then names what is
missing or unknown). The body is then validated and served exactly as on that route
(same field rule, same answers), so ``/invocations`` adds no behaviour of its own.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body, Depends, Request
from fastapi.responses import Response

from xservice.protocol import ChatCompletionRequest, CompletionRequest
from xservice.protocol.embeddings import EmbeddingRequest
from xservice.routes.body_route import BodyRoute
from xservice.routes.error_responses import GENERATION_ERRORS, errors
from xservice.serving.chat import create_chat_completion
from xservice.serving.completions import create_completion
from xservice.serving.context import ServingContext, get_ctx
from xservice.serving.embeddings import create_embeddings

router = APIRouter(route_class=BodyRoute)

# body key -> (request model, handler), first match wins
_APIS = (
    ("messages", ChatCompletionRequest, create_chat_completion),
    ("prompt", CompletionRequest, create_completion),
    ("input", EmbeddingRequest, create_embeddings),
)


@router.post("/invocations", responses=errors(*GENERATION_ERRORS))
async def invocations(
    request: Request, body: dict[str, Any] = Body(...), ctx: ServingContext = Depends(get_ctx)
) -> Response:
    key, model, handler = next((api for api in _APIS if api[0] in body), _APIS[0])  # else: chat's 400s
    # validated as the API's own route validates it (the same 400s), off the loop when large
    validated = await ctx.bodies.validate(model, body, len(await request.body()))
    return await handler(ctx, validated, request)
