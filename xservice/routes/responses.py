"""``POST /v1/responses`` (stateless), and the routes of stored responses, which answer 404: none are kept."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from xservice.protocol.responses import ResponseObject, ResponsesRequest
from xservice.serving.context import ServingContext, get_ctx
from xservice.serving.responses import create_response, not_stored

router = APIRouter()

_STREAM_DOC = {
    200: {
        "model": ResponseObject,
        "description": "The response as JSON; with 'stream: true', a text/event-stream of OpenAI's named "
        "response events ('event: <type>' and 'data: <event JSON>'), ending with 'response.completed' or "
        "'response.incomplete'.",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    }
}


@router.post("/v1/responses", responses=_STREAM_DOC)
async def responses(
    body: ResponsesRequest, request: Request, ctx: ServingContext = Depends(get_ctx)
) -> Response:
    return await create_response(ctx, body, request)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str) -> Response:
    raise not_stored(response_id)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str) -> Response:
    raise not_stored(response_id)


@router.get("/v1/responses/{response_id}/input_items")
async def response_input_items(response_id: str) -> Response:
    raise not_stored(response_id)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str) -> Response:
    raise not_stored(response_id)
