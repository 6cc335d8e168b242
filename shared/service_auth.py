"""The optional shared token between services (``service_token``), for deployments without
NetworkPolicies: encoders and LLMs refuse callers that do not present it (the gateway, and LLMs
fetching media from encoders, send it). Health, readiness and metrics stay open for probes and
scrapers; they carry no request data."""

from __future__ import annotations

import hmac
import json

SERVICE_TOKEN_HEADER = "x-mmserve-service-token"
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


def token_headers(token: str | None) -> dict[str, str]:
    """Headers a caller sends: the token, when one is set."""
    return {SERVICE_TOKEN_HEADER: token} if token else {}


class ServiceTokenMiddleware:
    """Pure ASGI: an HTTP request to a path outside ``OPEN_PATHS`` without the token is a 401."""

    def __init__(self, app, token: str) -> None:
        if not token:
            raise ValueError("ServiceTokenMiddleware needs a token")
        self.app = app
        self._token = token.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        presented = dict(scope["headers"]).get(SERVICE_TOKEN_HEADER.encode(), b"")
        if hmac.compare_digest(presented, self._token):
            return await self.app(scope, receive, send)
        body = json.dumps({"error": {"message": f"missing or wrong service token (header {SERVICE_TOKEN_HEADER})",
                                     "type": "invalid_request_error", "param": None,
                                     "code": "invalid_service_token"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
