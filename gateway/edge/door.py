"""The API key checked at the door: pure ASGI middleware that answers 401 before the request
body is read, so a caller without a key costs a header parse, never a body read or a JSON parse.

Protected: ``/v1/*``, ``/tokenize``, ``/detokenize`` and ``/dashboard/data``. Open: the probes and
the scrape (``/healthz``, ``/readyz``, ``/metrics``), the dashboard's page and its static files
(they hold no data; the page sends the key to ``/dashboard/data`` itself), the API docs. Off when
``api_keys`` is empty (start-up then warns if the gateway listens beyond loopback)."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.edge.auth import key_ok
from gateway.errors import APIError

PROTECTED_PREFIXES = ("/v1/",)
PROTECTED_PATHS = frozenset({"/tokenize", "/detokenize", "/dashboard/data"})


def is_protected(path: str) -> bool:
    """Whether ``path`` needs an API key (when keys are configured)."""
    return path in PROTECTED_PATHS or path.startswith(PROTECTED_PREFIXES)


def bearer_token(scope: Scope) -> str:
    """The token of an ``Authorization: Bearer <token>`` header, or ""."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return ""


# a refused request's body up to this size is drained (the server has most of it buffered
# already, and the connection stays usable); a larger or chunked one closes the connection
DRAIN_MAX_BYTES = 64 * 1024


def drains_cheaply(scope: Scope) -> bool:
    """No body, or a declared one small enough to drain rather than drop the connection."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return value.isdigit() and int(value) <= DRAIN_MAX_BYTES
        if name == b"transfer-encoding":
            return False
    return True


async def refuse_unread(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    """Answer ``error`` without reading the body. With a large body still coming the connection
    is closed after the answer: kept alive, the server would first drain every byte of it."""
    if not drains_cheaply(scope):
        error.headers.setdefault("Connection", "close")
    await error.response()(scope, receive, send)


class ApiKeyMiddleware:
    """401 for a protected path without a valid bearer key, before anything reads the body."""

    def __init__(self, app: ASGIApp, keys: list[str]) -> None:
        self.app = app
        self.keys = list(keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.keys and scope["type"] == "http" and is_protected(scope["path"]):
            token = bearer_token(scope)
            if not token or not key_ok(token, self.keys):
                message = ("missing API key: send 'Authorization: Bearer <key>'" if not token
                           else "incorrect API key provided")
                await refuse_unread(APIError(401, message, code="invalid_api_key"), scope, receive, send)
                return
        await self.app(scope, receive, send)
