"""Errors the encoder service answers with, each mapped to an HTTP status and an OpenAI body."""

from __future__ import annotations

import re

from fastapi import Request
from fastapi.responses import JSONResponse

from shared.schemas import ErrorDetail, ErrorResponse


class EncodeError(Exception):
    """A request-level failure; ``message`` tells the caller what to fix."""

    status: int = 500
    type: str = "server_error"
    headers: dict[str, str] | None = None

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


class DecodeTooSlow(MediaTooLarge):
    """Decoding one item ran past ``decode_timeout_s``; the decoder stopped."""


class ClientGone(EncodeError):
    """The caller disconnected before its encode finished (nginx's 499; nobody reads it)."""

    status = 499
    type = "invalid_request_error"


class NotReady(EncodeError):
    status = 503
    type = "server_error"


class EncodeTimeout(EncodeError):
    status = 504
    type = "server_error"


class Busy(EncodeError):
    """Admission control refused the request: too many in flight and queued."""

    status = 429
    type = "rate_limit_error"

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.headers = {"Retry-After": str(retry_after)}


class ForwardFailed(EncodeError):
    """The model forward of a batch failed; every request in that batch gets this."""

    status = 500
    type = "server_error"


_SOURCE_PATH = re.compile(r"\S*/\S+\.(?:cpp|cc|c|h|py):\d+\S*")
_OBJECT_REPR = re.compile(r"<[^<>]*\bat 0x[0-9a-fA-F]+>")  # <_io.BytesIO object at 0x7f...>
_LOG_STAMP = re.compile(r"^\[\d{2}:\d{2}:\d{2}\]\s*")  # dmlc/decord log prefix
_CHECK_FAILED = re.compile(r"Check failed:.*?(?:ERROR\s+|$)")  # decord asserts: keep its ERROR text


def short_reason(e: BaseException) -> str:
    """A library's error as a client may see it: first line only, without build paths, object
    addresses or internal assertion text; empty becomes the exception's type name."""
    text = (str(e).strip().splitlines() or [""])[0]
    text = _LOG_STAMP.sub("", text)
    text = _SOURCE_PATH.sub("", text)
    text = _OBJECT_REPR.sub("", text).replace("  ", " ")
    text = re.sub(r"^\w+Decoder,\s*", "", text)  # torchcodec class prefix
    text = _CHECK_FAILED.sub("", text).strip(" ,:")
    return (text or "the decoder rejected the data")[:160]


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None) -> dict:
    return ErrorResponse(error=ErrorDetail(message=message, type=type_, param=param)).model_dump()


async def encode_error_handler(_: Request, exc: EncodeError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.type, exc.param), status_code=exc.status, headers=exc.headers)


async def unexpected_error_handler(_: Request, exc: Exception) -> JSONResponse:
    """Anything else is our bug: a 500 in the same OpenAI shape, never a bare text page."""
    import logging

    logging.getLogger("encoder_svc").exception("unhandled error", exc_info=exc)
    return JSONResponse(error_body(f"internal encoder error ({type(exc).__name__}); see the encoder log",
                                   "server_error"), status_code=500)
