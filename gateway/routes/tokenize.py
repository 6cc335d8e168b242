"""vLLM's ``POST /tokenize`` and ``POST /detokenize``, answered by an LLM replica (it holds the
tokenizer and the chat template); the model name is checked here."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from gateway.edge.auth import ApiKeyDep
from gateway.errors import APIError
from gateway.openai_api.request_limits import check_tools
from gateway.state import StateDep
from gateway.openai_api.validate import check_model, check_template
from shared.schemas import DetokenizeRequest, TokenizeRequest

router = APIRouter(dependencies=[ApiKeyDep])


def _check_model(state, model: str | None) -> None:
    if model is not None:
        check_model(model, state.model_name)


async def _forward(state, path: str, payload: dict) -> JSONResponse:
    status, body = await state.llms.post_json(path, payload)
    if status >= 400 and not (isinstance(body, dict) and isinstance(body.get("error"), dict)):
        # a replica that does not serve the path (an older build), or a body that is not ours:
        # an OpenAI error naming what failed, never the replica's raw answer
        raise APIError(502, f"the LLM replica could not answer {path} (HTTP {status}); retry later")
    if status >= 500 and status != 503:
        status = 502
    return JSONResponse(body, status_code=status)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: StateDep) -> JSONResponse:
    _check_model(state, body.model)
    check_template(body.chat_template_kwargs, state.settings.trust_request_chat_template)
    check_tools(body, state.settings)
    return await _forward(state, "/tokenize", body.model_dump(exclude={"model"}, exclude_none=True))


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: StateDep) -> JSONResponse:
    _check_model(state, body.model)
    return await _forward(state, "/detokenize", body.model_dump(exclude={"model"}))
