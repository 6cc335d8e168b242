"""Optional bearer-token auth for ``/v1/*`` and the dashboard: off when ``api_keys`` is empty.

The dashboard's page is opened by a browser, which sends no header on a navigation: it also
takes the key as ``?key=`` (its script sends it on as a bearer header to ``/dashboard/data``)."""

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
    keys = request.app.state.gateway.settings.api_keys
    if keys:
        _check(keys, _bearer(request))


async def require_dashboard_key(request: Request) -> None:
    """Like ``require_api_key``, or the key as the ``key`` query parameter."""
    keys = request.app.state.gateway.settings.api_keys
    if keys:
        _check(keys, _bearer(request) or request.query_params.get("key", "").strip())


ApiKeyDep = Depends(require_api_key)
DashboardKeyDep = Depends(require_dashboard_key)
