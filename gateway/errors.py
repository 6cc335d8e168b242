"""OpenAI-shaped errors: one exception type and the handlers that render every failure as
``{"error": {"message", "type", "param", "code"}}`` (never a bare 500 or a FastAPI ``detail``)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shared.schemas import ErrorDetail, ErrorResponse

log = logging.getLogger("mmserve.gateway")

ENV_PREFIX = "MMSERVE_GATEWAY_"

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def setting_ref(field: str) -> str:
    """How an error names a gateway setting: the field and its environment variable."""
    return f"{field} ({ENV_PREFIX}{field.upper()})"


class APIError(Exception):
    """An error the client should see with this status and OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.headers = dict(headers or {})
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        detail = ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=detail).model_dump()

    def response(self) -> JSONResponse:
        headers = dict(self.headers)
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def loc_to_param(loc: tuple[Any, ...]) -> str:
    """``('body', 'messages', 0, 'content', 'list[...]', 1, 'foo')`` -> ``messages[0].content[1].foo``.

    Pydantic inserts union/tag names (``list[...]``, ``str``, ``image_url``) into locations; they
    name schema branches, not request fields, so they are dropped when they contain brackets or
    follow a list index as a tag."""
    out = ""
    for k, part in enumerate(loc):
        if part == "body" and not out:
            continue
        if k and isinstance(loc[k - 1], int) and k + 1 < len(loc) and loc[k + 1] == part:
            continue  # a discriminator tag: [0].input_audio.input_audio.format
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in str(part) or str(part) in ("str", "int", "float", "bool", "none"):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = list(exc.errors())
    if not errors:
        return "invalid request", None
    for e in errors:
        if e.get("type") == "json_invalid":
            ctx = e.get("ctx") or {}
            return f"request body is not valid JSON: {ctx.get('error', e.get('msg'))}", None
    # a union reports one error per branch; the deepest location is the branch the client meant
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    if tuple(first.get("loc", ())) == ("body",):
        return f"request body must be a JSON object: {first.get('msg')}", None
    param = loc_to_param(tuple(first.get("loc", ())))
    msg = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return msg, param or None


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    msg, param = validation_message(exc)
    return APIError(400, msg, param=param).response()


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 413: "request_too_large"}.get(exc.status_code)
    # keep the exception's headers: a 405 must say which methods are allowed (RFC 9110)
    return APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers).response()


async def _unhandled(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error: %s", exc)
    return APIError(500, f"internal error: {type(exc).__name__}").response()


def install_error_handlers(app: FastAPI) -> None:
    """Every error path of the app renders as an OpenAI error body."""
    app.add_exception_handler(APIError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unhandled)
