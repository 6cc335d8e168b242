"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` with the served model's tokenizer and chat
template (what a client needs to count tokens or build ``logit_bias`` before it sends a chat)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from shared.schemas import (
    DetokenizeRequest, DetokenizeResponse, PromptMessage, PromptText, TextPart, TokenizeRequest, TokenizeResponse,
)

from llm_svc.types.errors import InvalidRequest, error_body
from .prompt import check_length, render_text_ids
from llm_svc.loading.prompt_bound import tokens_past
from .routes import StateDep

router = APIRouter()


def _bad(message: str, param: str) -> JSONResponse:
    return JSONResponse(status_code=400, content=error_body(message, "invalid_request_error", param, None))


def _not_ready(state) -> JSONResponse | None:
    if state.lm is None:
        return JSONResponse(status_code=503, content=error_body(
            f"the model is not loaded ({state.not_ready_detail}); retry later", "service_unavailable", None, None))
    return None


def _model_ok(state, model: str | None) -> JSONResponse | None:
    if model is not None and state.model_name is not None and model != state.model_name:
        return JSONResponse(status_code=404, content=error_body(
            f"The model `{model}` does not exist", "invalid_request_error", "model", "model_not_found"))
    return None


def _tokenize_body(lm, body: TokenizeRequest, msgs: list[PromptMessage] | None, max_model_len: int,
                   trust_template: bool) -> list[int]:
    """The ids of ``body`` (on a prep worker: rendering and tokenizing a long input holds the GIL).
    Bounded by chat's rule: a text that cannot fit ``max_model_len`` tokens is refused (400)
    before it is rendered, or as soon as tokenizing shows it cannot fit."""
    if body.prompt is not None:
        text_bytes = len(body.prompt.encode("utf-8", "replace"))
        check_length(lm.min_tokens(text_bytes), 0, max_model_len, "prompt", at_least=True, text_bytes=text_bytes)
        special = True if body.add_special_tokens is None else body.add_special_tokens
        at_least = tokens_past(lm.tokenizer, lm.bound, body.prompt, max_model_len, special)
        if at_least is not None:
            check_length(at_least, 0, max_model_len, "prompt", at_least=True)
        return list(lm.tokenizer(body.prompt, add_special_tokens=special)["input_ids"])
    text_bytes = sum(len(p.text.encode("utf-8", "replace")) for m in msgs for p in m.content)
    check_length(lm.min_tokens(text_bytes), 0, max_model_len, "messages", at_least=True, text_bytes=text_bytes)
    ids = render_text_ids(lm, msgs, add_generation_prompt=body.add_generation_prompt, tools=body.tools,
                          kwargs=body.chat_template_kwargs, trust_template=trust_template)
    check_length(len(ids), 0, max_model_len, "messages")
    if body.add_special_tokens:
        ids = list(lm.tokenizer.build_inputs_with_special_tokens(ids))
    return ids


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: StateDep) -> JSONResponse:
    if (r := _not_ready(state) or _model_ok(state, body.model)) is not None:
        return r
    msgs = None
    if body.messages is not None:
        msgs = []
        for i, m in enumerate(body.messages):
            parts = m.parts()
            if not all(isinstance(p, TextPart) for p in parts):
                return _bad(f"messages[{i}]: /tokenize takes text parts only", f"messages[{i}].content")
            msgs.append(PromptMessage.of(m, [PromptText(text=p.text) for p in parts]))
    s = state.settings
    try:  # off the event loop, as /v1/generate's prompts: streams, the watchdog and /healthz keep answering
        ids = await state.prep.run(_tokenize_body, body, msgs, s.max_model_len, s.trust_request_chat_template)
    except InvalidRequest as e:
        return JSONResponse(status_code=400, content=error_body(e.message, "invalid_request_error", e.param, e.code))
    except Exception as e:  # a template that refuses the conversation (e.g. roles out of order)
        return _bad(f"the model's chat template refused these messages: {str(e)[:300]}", "messages")
    lm = state.lm
    strs = lm.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    resp = TokenizeResponse(count=len(ids), max_model_len=s.max_model_len, tokens=ids, token_strs=strs)
    return JSONResponse(resp.model_dump(exclude_none=True))


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: StateDep) -> JSONResponse:
    if (r := _not_ready(state) or _model_ok(state, body.model)) is not None:
        return r
    bad = [t for t in body.tokens if not 0 <= t < state.lm.vocab_size]
    if bad:
        return _bad(f"tokens {bad[:10]} are outside the vocabulary [0, {state.lm.vocab_size})", "tokens")
    return JSONResponse(DetokenizeResponse(prompt=state.lm.tokenizer.decode(body.tokens)).model_dump())
