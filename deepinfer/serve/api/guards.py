"""ASGI middleware that answers before a route runs: the API key and the body size limit.

Plain ASGI on purpose: Starlette's BaseHTTPMiddleware (@app.middleware) hides client
disconnects from request.is_disconnected(), so abandoned non-streaming requests would keep
generating.
"""
from __future__ import annotations

import hmac

from starlette.exceptions import HTTPException

from deepinfer.serve.api.errors import error_response


class APIKeyMiddleware:
    """Every path but `open_paths` needs `Authorization: Bearer <key>`: state-changing ones
    (/reset_prefix_cache), costly ones (/tokenize) and revealing ones (/metrics) alike."""

    def __init__(self, app, api_key: str, open_paths: frozenset[str]) -> None:
        self.app, self.api_key, self.open_paths = app, api_key, open_paths

    @staticmethod
    def authorized(scope, api_key: str) -> bool:
        auth = dict(scope["headers"]).get(b"authorization", b"")
        # Constant time: the comparison must not tell how much of a guess was right.
        return hmac.compare_digest(auth, f"Bearer {api_key}".encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths \
                and not self.authorized(scope, self.api_key):
            response = error_response("Incorrect API key provided.", 401, None,
                                      "invalid_api_key")
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a body over `max_bytes`: at once when Content-Length says so, else as soon as
    the bytes read pass it (chunked uploads), before the whole body is buffered."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await error_response(self._message(), 413)(scope, receive, send)
            return
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI lets an HTTPException from reading the body through as it is;
                    # the app's handler turns it into the OpenAI error body.
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, limited_receive, send)

    def _message(self) -> str:
        return (f"the request body is larger than this server's limit of "
                f"{self.max_bytes / (1 << 20):g} MB (--max-request-body-mb)")
