"""``POST /v1/responses`` (stateless), and the routes of stored responses, which answer 404: none are kept."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from xservice.protocol.responses import ResponseObject, ResponsesRequest
from xservice.routes.body_route import BodyRoute
from xservice.routes.error_responses import GENERATION_ERRORS, errors
from xservice.serving.context import ServingContext, get_ctx
from xservice.serving.responses import create_response, not_stored
from xservice.serving.sse_schema import event_stream_schema

router = APIRouter(route_class=BodyRoute)

# One event's ``data``: every event names its ``type`` (and, but the error event, its ``sequence_number``).
_EVENT_SCHEMA = {
    "type": "object",
    "required": ["type"],
    "properties": {"type": {"type": "string"}, "sequence_number": {"type": "integer"}},
    "description": "One response event (OpenAI's Responses streaming events), its type also the SSE event name.",
}
_STREAM_DOC = {
    200: {
        "model": ResponseObject,
        "description": "The response as JSON; with 'stream: true', a text/event-stream of OpenAI's named "
        "response events ('event: <type>' and 'data: <event JSON>'), ending with 'response.completed' or "
        "'response.incomplete'.",
        "content": {
            "text/event-stream": {
                "schema": event_stream_schema(
                    _EVENT_SCHEMA, "One event: 'event: <type>' and 'data: <event JSON>'.", done=False
                )
            }
        },
    }
}


@router.post("/v1/responses", responses={**_STREAM_DOC, **errors(*GENERATION_ERRORS)})
async def responses(
    body: ResponsesRequest, request: Request, ctx: ServingContext = Depends(get_ctx)
) -> Response:
    return await create_response(ctx, body, request)


@router.get("/v1/responses/{response_id}", responses=errors(404))
async def get_response(response_id: str) -> Response:
    raise not_stored(response_id)


@router.delete("/v1/responses/{response_id}", responses=errors(404))
async def delete_response(response_id: str) -> Response:
    raise not_stored(response_id)


@router.get("/v1/responses/{response_id}/input_items", responses=errors(404))
async def response_input_items(response_id: str) -> Response:
    raise not_stored(response_id)


@router.post("/v1/responses/{response_id}/cancel", responses=errors(404))
async def cancel_response(response_id: str) -> Response:
    raise not_stored(response_id)
