"""``POST /v1/completions`` (OpenAI's legacy text completions, as vLLM serves them): a prompt
string or token ids, or a batch of them (one choice each), on an LLM replica; JSON or SSE
(``gateway.pipeline.completions``)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.edge.auth import ApiKeyDep
from gateway.openai_api.answer_format import CompletionChunkWriter, completion_id, now, text_completion
from gateway.openai_api.request_limits import check_completion_prompts, check_grammar_size
from gateway.openai_api.requests import CompletionRequest
from gateway.openai_api.validate import check_model
from gateway.pipeline.answer import answer
from gateway.pipeline.completions import generate, generate_requests, open_stream
from gateway.state import StateDep

router = APIRouter(dependencies=[ApiKeyDep])


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: StateDep) -> Response:
    check_model(body.model, state.model_name)
    check_completion_prompts(body, state.settings)  # before one generation request is built
    check_grammar_size(body, state.settings)
    cid, created, start = completion_id("cmpl"), now(), time.monotonic()
    gens = generate_requests(state, body, cid)
    logprobs = body.logprobs is not None
    echo_top = body.logprobs if body.echo else None  # echo with logprobs: the prompt's lead them

    async def plain() -> dict:
        return text_completion(await generate(state, gens, body.n), body.model, cid, created, logprobs,
                               n=body.n, echo_top=echo_top, prompt_top=body.prompt_logprobs_field()).model_dump()

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await answer(request, state, cid, start, body.stream, plain,
                        lambda: open_stream(state, gens[0], body.n),
                        CompletionChunkWriter(cid, created, body.model, include_usage, logprobs, echo_top or 0))
