"""Optional bearer-token auth for ``/v1/*``, ``/tokenize``, ``/detokenize`` and the dashboard's
data: off when ``api_keys`` is empty.

The key is checked first at the door (``gateway.edge.door``, before the body is read); the routes'
dependency checks it again, so a route is never open because a path was left out of the door's
list. A key travels only in the ``Authorization`` header, never in a URL (URLs end up in access
logs and browser history): the dashboard page takes it from the URL fragment, which the browser
does not send, and sends it on as a bearer header."""

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


def _check(keys: list[str], token: str) -> None:
    if not token:
        raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
    if not key_ok(token, keys):
        raise APIError(401, "incorrect API key provided", code="invalid_api_key")


def _bearer(request: Request) -> str:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


async def require_api_key(request: Request) -> None:
    """401 unless the request carries one of ``api_keys`` as a bearer token (none set: open)."""
    keys = request.app.state.gateway.settings.api_keys
    if keys:
        _check(keys, _bearer(request))


ApiKeyDep = Depends(require_api_key)
DashboardKeyDep = ApiKeyDep  # the dashboard's data: the same bearer key, no query-string form
