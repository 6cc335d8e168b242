"""Optional bearer-token auth for ``/v1/*``: off when ``api_keys`` is empty."""

from __future__ import annotations

import hmac

from fastapi import Depends, Request

from gateway.errors import APIError


def key_ok(presented: str, keys: list[str]) -> bool:
    """Constant-time comparison against every configured key."""
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(presented.encode(), k.encode())
    return ok


async def require_api_key(request: Request) -> None:
    keys = request.app.state.gateway.settings.api_keys
    if not keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
    if not key_ok(token.strip(), keys):
        raise APIError(401, "incorrect API key provided", code="invalid_api_key")


ApiKeyDep = Depends(require_api_key)
