"""``POST /v1/chat/completions/batch`` (vLLM's batched chat completions; see ``serving/chat_batch.py``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body, Depends, Request
from fastapi.responses import Response

from xservice.protocol import ChatCompletionResponse
from xservice.routes.body_route import BodyRoute
from xservice.routes.error_responses import GENERATION_ERRORS, errors
from xservice.serving.chat_batch import create_batch_chat_completion
from xservice.serving.context import ServingContext, get_ctx

router = APIRouter(route_class=BodyRoute)


@router.post(
    "/v1/chat/completions/batch",
    response_model=ChatCompletionResponse,
    responses=errors(*GENERATION_ERRORS),
)
async def chat_completions_batch(
    request: Request, body: dict[str, Any] = Body(...), ctx: ServingContext = Depends(get_ctx)
) -> Response:
    return await create_batch_chat_completion(ctx, body, request)
