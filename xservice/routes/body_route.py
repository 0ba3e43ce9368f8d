"""``BodyRoute``: a FastAPI route whose JSON body is parsed by the app's ``BodyParser`` (off the event loop
when large) instead of by FastAPI on the loop.

A route declares its body as usual (``body: ChatCompletionRequest``), so ``/openapi.json`` documents it
exactly as before. Before FastAPI reads the body, this route's handler decodes it, applies the cheap
counts and, when the declared body is a ``RequestModel``, validates it (``xservice/serving/body_parse.py``);
FastAPI then receives the validated model, which it accepts as it is (an instance of the declared model is
not validated again). Bodies that are not ``application/json`` are left to FastAPI, which answers them as
before. Use it with ``APIRouter(route_class=BodyRoute)``.
"""

from __future__ import annotations

import email.message
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from xservice.protocol.request_model import RequestModel


class BodyRoute(APIRoute):
    """An ``APIRoute`` whose JSON body is decoded, counted and validated by ``ServingContext.bodies``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler
        declared = self.body_field.field_info.annotation
        model = declared if isinstance(declared, type) and issubclass(declared, RequestModel) else None

        async def parse_then_handle(request: Request) -> Response:
            if _is_json(request):
                body = await request.body()
                if body:
                    parsed = await request.app.state.ctx.bodies.parse(body, model)
                    request = _ParsedRequest(request, body, parsed)
            return await handler(request)

        return parse_then_handle


def _is_json(request: Request) -> bool:
    """Whether FastAPI would decode this request's body as JSON (its own content-type rule)."""
    value = request.headers.get("content-type")
    if not value:
        return False
    message = email.message.Message()
    message["content-type"] = value
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


class _ParsedRequest(Request):
    """``request`` whose body was read (``body``) and parsed (``parsed``, what ``json()`` returns)."""

    def __init__(self, request: Request, body: bytes, parsed: Any) -> None:
        super().__init__(request.scope, request.receive)
        self._raw = body
        self._parsed = parsed

    async def body(self) -> bytes:
        return self._raw

    async def json(self) -> Any:
        return self._parsed
