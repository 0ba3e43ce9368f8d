"""``POST /v1/chat/completions``."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from xservice.protocol import ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse
from xservice.routes.body_route import BodyRoute
from xservice.routes.error_responses import GENERATION_ERRORS, errors
from xservice.serving.chat import create_chat_completion
from xservice.serving.context import ServingContext, get_ctx
from xservice.serving.sse_schema import stream_responses

router = APIRouter(route_class=BodyRoute)


@router.post(
    "/v1/chat/completions",
    responses={
        **stream_responses(ChatCompletionResponse, ChatCompletionChunk),
        **errors(*GENERATION_ERRORS),
    },
)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, ctx: ServingContext = Depends(get_ctx)
) -> Response:
    return await create_chat_completion(ctx, body, request)
