"""Request body size limit, enforced before the JSON is parsed (inline base64 media make chat
requests large; an unbounded body would be read into memory whole)."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import APIError


def body_limit(max_request_media_bytes: int) -> int:
    """Largest accepted body: the media budget base64-encoded, plus room for the text."""
    return max_request_media_bytes * 4 // 3 + 8 * 1024 * 1024


class BodyLimitMiddleware:
    """413 when Content-Length (or, for chunked bodies, the bytes read so far) exceeds ``limit``."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                response = APIError(413, f"request body exceeds {self.limit} bytes", code="request_too_large").response()
                await response(scope, receive, send)
                return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise HTTPException(413, f"request body exceeds {self.limit} bytes")
            return message

        await self.app(scope, limited_receive, send)
