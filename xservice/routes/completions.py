"""``POST /v1/completions``."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from xservice.protocol import CompletionRequest, CompletionResponse
from xservice.routes.body_route import BodyRoute
from xservice.routes.error_responses import GENERATION_ERRORS, errors
from xservice.serving.completions import create_completion
from xservice.serving.context import ServingContext, get_ctx
from xservice.serving.sse_schema import stream_responses

router = APIRouter(route_class=BodyRoute)


@router.post(
    "/v1/completions",
    responses={**stream_responses(CompletionResponse, CompletionResponse), **errors(*GENERATION_ERRORS)},
)
async def completions(
    body: CompletionRequest, request: Request, ctx: ServingContext = Depends(get_ctx)
) -> Response:
    return await create_completion(ctx, body, request)
