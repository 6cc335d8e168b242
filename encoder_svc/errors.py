"""Errors the encoder service answers with, each mapped to an HTTP status and an OpenAI body."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from shared.schemas import ErrorDetail, ErrorResponse


class EncodeError(Exception):
    """A request-level failure; ``message`` tells the caller what to fix."""

    status: int = 500
    type: str = "server_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class BadMedia(EncodeError):
    """The bytes cannot be decoded as the declared modality."""

    status = 400
    type = "invalid_request_error"


class UnsupportedModality(BadMedia):
    """The bundle has no encoder for this modality."""


class MediaTooLarge(EncodeError):
    """The body or the decoded media exceeds a configured limit."""

    status = 413
    type = "invalid_request_error"


class NotReady(EncodeError):
    status = 503
    type = "server_error"


class EncodeTimeout(EncodeError):
    status = 504
    type = "server_error"


class ForwardFailed(EncodeError):
    """The model forward of a batch failed; every request in that batch gets this."""

    status = 500
    type = "server_error"


def short_reason(e: BaseException) -> str:
    """First line of a library's error, without build paths, for a client-facing message."""
    import re

    text = (str(e).strip().splitlines() or [""])[0]
    text = re.sub(r"\S*/\S+\.(?:cpp|cc|c|h|py):\d+\S*", "", text).strip(" ,:")
    return (text or type(e).__name__)[:160]


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None) -> dict:
    return ErrorResponse(error=ErrorDetail(message=message, type=type_, param=param)).model_dump()


async def encode_error_handler(_: Request, exc: EncodeError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.type, exc.param), status_code=exc.status)


async def unexpected_error_handler(_: Request, exc: Exception) -> JSONResponse:
    """Anything else is our bug: a 500 in the same OpenAI shape, never a bare text page."""
    import logging

    logging.getLogger("encoder_svc").exception("unhandled error", exc_info=exc)
    return JSONResponse(error_body(f"internal encoder error: {type(exc).__name__}: {exc}", "server_error"), status_code=500)
