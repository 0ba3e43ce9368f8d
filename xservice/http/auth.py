"""Optional API-key check on every route but the health probes (pure ASGI middleware)."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from xservice.http.errors import AuthenticationError, error_response

OPEN_PATHS = frozenset({"/health", "/health/live", "/health/ready"})


def _bearer_token(scope: Scope) -> bytes:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else b""
    return b""


class ApiKeyMiddleware:
    """Reject requests whose ``Authorization: Bearer`` token is not ``api_key`` with 401."""

    def __init__(self, app: ASGIApp, api_key: str, on_error=None) -> None:
        self.app = app
        self.api_key = api_key.encode()
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        token = _bearer_token(scope)
        # compare_digest runs in time independent of where the strings differ.
        if hmac.compare_digest(token, self.api_key):
            await self.app(scope, receive, send)
            return
        message = "Missing API key." if not token else "Incorrect API key provided."
        if self.on_error is not None:
            self.on_error(401)
        await error_response(AuthenticationError(message))(scope, receive, send)
