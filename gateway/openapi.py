"""The gateway's OpenAPI document says what it really answers: errors are OpenAI error bodies
with status 400 (never FastAPI's 422), every route may answer the statuses its middleware and
upstream policy produce (401, 404, 413, 429, 5xx), and ``/metrics`` is Prometheus text."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from shared.schemas import ErrorResponse

_ERROR_STATUSES = {
    "400": "Invalid request (the message says what to fix)",
    "401": "Missing or wrong API key",
    "404": "Unknown model or path",
    "413": "Request body too large",
    "429": "Overloaded: retry after the Retry-After seconds",
    "500": "Internal error",
    "502": "Every upstream replica failed",
    "503": "No upstream replica is serving",
    "504": "The request timed out",
}
_TEXT_ROUTES = {"/metrics": "text/plain", "/dashboard": "text/html"}


def _error_response(description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}


def install_openapi(app: FastAPI) -> None:
    """Replace ``app.openapi`` with the corrected document (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        schemas["ErrorResponse"] = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in schemas["ErrorResponse"].pop("$defs", {}).items():
            schemas.setdefault(name, sub)
        for drop in ("HTTPValidationError", "ValidationError"):
            schemas.pop(drop, None)
        for path, ops in doc.get("paths", {}).items():
            for op in ops.values():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                for status, description in _ERROR_STATUSES.items():
                    responses.setdefault(status, _error_response(description))
                if path in _TEXT_ROUTES:
                    responses["200"] = {"description": f"{_TEXT_ROUTES[path]} page",
                                        "content": {_TEXT_ROUTES[path]: {"schema": {"type": "string"}}}}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
