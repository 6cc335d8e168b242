"""Limits taken before the work: the request body's size per endpoint, capped while it streams
in (a body is read into memory whole before the JSON is parsed; inline base64 media make chat
requests large, nothing else needs to be), and the admission slot, taken before the body is
read (under overload a refusal should cost the event loop as little as it can)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.edge.door import refuse_unread
from gateway.errors import APIError, setting_ref
from shared.admission import Overloaded

# the scope key under which AdmissionMiddleware hands its ticket to the route
TICKET_SCOPE_KEY = "mmserve.admission_ticket"


def body_limit(max_request_media_bytes: int) -> int:
    """Largest accepted body: the media budget base64-encoded, plus room for the text."""
    return max_request_media_bytes * 4 // 3 + 8 * 1024 * 1024


@dataclass(frozen=True)
class BodyLimit:
    """A body size cap and the setting that sets it (named in the 413)."""

    max_bytes: int
    setting: str

    def message(self, path: str) -> str:
        return (f"request body exceeds {self.max_bytes} bytes, the limit for {path} (setting "
                f"{setting_ref(self.setting)}); send a smaller body or raise the setting")


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` when a body outgrows its limit while streaming in; FastAPI lets
    an ``HTTPException`` from the body read through to the error handlers (a 413, OpenAI-shaped),
    and the connection is closed rather than drained."""

    def __init__(self, message: str) -> None:
        super().__init__(413, message, headers={"Connection": "close"})


class BodyLimitMiddleware:
    """413 when Content-Length (or, for chunked bodies, the bytes read so far) exceeds the
    path's limit (``limits``, else ``default``)."""

    def __init__(self, app: ASGIApp, limits: Mapping[str, BodyLimit], default: BodyLimit) -> None:
        self.app = app
        self.limits = dict(limits)
        self.default = default

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limits.get(scope["path"], self.default)
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > limit.max_bytes:
                error = APIError(413, limit.message(scope["path"]), code="request_too_large")
                await refuse_unread(error, scope, receive, send)
                return
        seen = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit.max_bytes:
                    raise BodyTooLarge(limit.message(scope["path"]))
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, watched_send)
        except BodyTooLarge as e:
            # an app that reads the body outside FastAPI's handlers: answered here if it can be
            if started:
                raise
            error = APIError(413, str(e.detail), code="request_too_large", headers=dict(e.headers or {}))
            await error.response()(scope, receive, send)


class AdmissionMiddleware:
    """Takes the admission slot of a generation (chat, completions, responses) before its body
    is read, parsed or validated, and holds it until the response has been sent: a 429 with
    ``Retry-After`` when every slot is taken and the queue is full (or the wait outlasts
    ``queue_timeout``). The ticket is left in the scope (``TICKET_SCOPE_KEY``) for the route,
    which may release it as soon as its answer is ready (release is idempotent)."""

    def __init__(self, app: ASGIApp, state_of: Callable, paths: frozenset[str], on_shed: Callable[[], None]) -> None:
        self.app = app
        self.state_of = state_of  # () -> GatewayState (built in the lifespan)
        self.paths = paths
        self.on_shed = on_shed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.state_of() if scope["type"] == "http" and scope["method"] == "POST" \
            and scope["path"] in self.paths else None
        if state is None:
            await self.app(scope, receive, send)
            return
        try:
            ticket = await state.admission.acquire()
        except Overloaded as e:
            self.on_shed()
            error = APIError(429, e.message, code="overloaded", headers={"Retry-After": str(e.retry_after)})
            await refuse_unread(error, scope, receive, send)
            return
        scope[TICKET_SCOPE_KEY] = ticket
        try:
            await self.app(scope, receive, send)
        finally:
            ticket.release()
