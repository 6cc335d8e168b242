"""``POST /v1/chat/completions``: the request checked, then the chat pipeline
(``gateway.pipeline.chat``) answers it as a ``ChatCompletion`` or as its SSE chunks."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.edge.auth import ApiKeyDep
from gateway.openai_api.answer_format import ChunkWriter, chat_completion, completion_id, now
from gateway.openai_api.requests import ChatCompletionRequest
from gateway.openai_api.validate import check_model
from gateway.pipeline import chat
from gateway.state import StateDep
from shared.schemas import GenerateResponse

router = APIRouter(dependencies=[ApiKeyDep])


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: StateDep) -> Response:
    chat.validate(state, body)
    check_model(body.model, state.model_name)
    cid, created, start = completion_id(), now(), time.monotonic()
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def shape(resps: list[GenerateResponse]) -> dict:
        return chat_completion(resps, body.model, cid, created, prompt_top=body.prompt_logprobs_wanted()).model_dump()

    return await chat.run(request, state, body, cid, start, shape, ChunkWriter(cid, created, body.model, include_usage))
