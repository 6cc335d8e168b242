"""Errors the LLM service turns into OpenAI-style 4xx/5xx bodies."""

from __future__ import annotations

from shared.schemas import ErrorDetail, ErrorResponse


class InvalidRequest(ValueError):
    """The request cannot be served as sent; ``message`` says what to fix."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return ErrorResponse(error=ErrorDetail(message=message, type=type_, param=param, code=code)).model_dump()
