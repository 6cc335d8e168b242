"""Checks of a chat request that pydantic cannot express, run before any work is done.

* every string must be encodable as UTF-8: JSON may carry a lone surrogate (``"\\ud800"``),
  which Python keeps in a ``str`` but nothing downstream can serialize;
* a prompt that cannot fit any LLM replica's context is refused before media are fetched or
  encoded and before anything is sent: its text alone is at least ``bytes / max_token_bytes``
  tokens (the replicas report both numbers on ``/readyz``); the gateway's one such check, for
  chat and completions alike (the replica counts exactly).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from gateway.errors import APIError
from gateway.openai_api.requests import ChatCompletionRequest
from shared.chat_template import TemplateKwargsError, check_template_kwargs
from shared.schemas import ServiceLimits, TextPart


def _bad_string(value: Any, path: str) -> str | None:
    """The path of the first string under ``value`` that UTF-8 cannot encode, or None."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, BaseModel):
        for name in type(value).model_fields:
            found = _bad_string(getattr(value, name), f"{path}.{name}" if path else name)
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = _bad_string(v, f"{path}[{i}]")
            if found:
                return found
    elif isinstance(value, dict):
        for k, v in value.items():
            found = _bad_string(v, f"{path}.{k}")
            if found:
                return found
    return None


def check_text(req: ChatCompletionRequest) -> None:
    """400 naming the field when a string holds a lone UTF-16 surrogate."""
    where = _bad_string(req, "")
    if where is not None:
        raise APIError(
            400, f"{where}: the text contains a lone UTF-16 surrogate (e.g. \\ud800), which is not valid "
            "Unicode; send well-formed UTF-8 text", param=where, code="invalid_text",
        )


def text_bytes(req: ChatCompletionRequest) -> int:
    """UTF-8 bytes of every text part of the request."""
    return sum(
        len(p.text.encode("utf-8")) for m in req.messages for p in m.parts() if isinstance(p, TextPart)
    )


def check_fits(req: ChatCompletionRequest, default_max_tokens: int, limits: ServiceLimits | None) -> None:
    """400 ``context_length_exceeded`` when the text alone cannot fit ``limits`` (None: unknown
    yet, the LLM replica checks)."""
    if limits is None:
        return
    n_bytes = text_bytes(req)
    check_context(n_bytes // limits.max_token_bytes, req.effective_max_tokens(default_max_tokens), limits,
                  "messages", n_bytes)


def check_context(at_least: int, max_tokens: int, limits: ServiceLimits | None, param: str,
                  n_bytes: int | None = None) -> None:
    """400 ``context_length_exceeded`` when a prompt of ``at_least`` tokens (a lower bound: the
    LLM replica counts exactly) and ``max_tokens`` exceed the replicas' context (None: unknown)."""
    if limits is None or at_least + max_tokens <= limits.max_model_len:
        return
    of_text = f" ({n_bytes} bytes of text)" if n_bytes is not None else ""
    raise APIError(
        400, f"the prompt has at least {at_least} tokens{of_text} and max_tokens is {max_tokens}: together they "
        f"exceed the model's context of {limits.max_model_len} tokens; shorten the prompt or lower max_tokens",
        param=param, code="context_length_exceeded",
    )


def check_model(requested: str, served: str) -> None:
    """404 ``model_not_found`` unless ``requested`` names the model this gateway serves."""
    if requested != served:
        raise APIError(404, f"The model `{requested}` does not exist", param="model", code="model_not_found")


def check_template(kwargs: dict | None, trust_request_template: bool) -> None:
    """400 for ``chat_template_kwargs`` the server refuses: a request's own Jinja template
    (unless ``trust_request_chat_template``) or an argument the server sets itself."""
    try:
        check_template_kwargs(kwargs, trust_request_template)
    except TemplateKwargsError as e:
        raise APIError(400, str(e), param="chat_template_kwargs") from None
