"""Request body size limit, enforced before the JSON is parsed (inline base64 media make chat
requests large; an unbounded body would be read into memory whole)."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.auth import key_ok
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


class ShedMiddleware:
    """A chat request arriving while the admission gate is full (every slot taken, the queue
    full) is answered 429 with ``Retry-After`` here, before its body is read, parsed or
    validated: under overload most requests are refused, and each refusal should cost the
    event loop as little as it can. What ``acquire`` would answer, only cheaper; requests with a
    key that is not valid (when keys are configured) go on to the route, which answers 401."""

    def __init__(self, app: ASGIApp, state_of, paths: frozenset[str], on_shed) -> None:
        self.app = app
        self.state_of = state_of  # () -> GatewayState (built in the lifespan)
        self.paths = paths
        self.on_shed = on_shed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.paths:
            state = self.state_of()
            if state is not None and self._key_ok(scope, state.settings.api_keys):
                refused = state.admission.shed()
                if refused is not None:
                    self.on_shed()
                    response = APIError(429, refused.message, code="overloaded",
                                        headers={"Retry-After": str(refused.retry_after)}).response()
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)

    @staticmethod
    def _key_ok(scope: Scope, keys: list[str]) -> bool:
        if not keys:
            return True
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and key_ok(token.strip(), keys)
        return False
