"""``POST /v1/completions`` (OpenAI's legacy text completions, as vLLM serves them): a prompt
string or token ids, or a batch of them (one choice each), on an LLM replica; JSON or SSE."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.edge.auth import ApiKeyDep
from gateway.openai_api.answer_format import CompletionChunkWriter, completion_id, now, text_completion
from gateway.pipeline.prompt import sampling_params
from gateway.openai_api.request_limits import check_completion_prompts, check_grammar_size
from gateway.pipeline.choices import ChoiceStreams, fan_out, generate_all, open_all
from gateway.openai_api.requests import CompletionRequest
from gateway.routes.chat import ABORTED, answer
from gateway.state import GatewayState, StateDep
from gateway.upstream import UpstreamError
from gateway.openai_api.validate import check_context, check_model
from shared.rawwire import pack_raw
from shared.schemas import GenerateRequest, GenerateResponse

router = APIRouter(dependencies=[ApiKeyDep])


def _generate_request(state: GatewayState, body: CompletionRequest, prompt: str | list[int], rid: str) -> GenerateRequest:
    limits = state.llm_limits.best()
    sp = sampling_params(body, state.settings.default_max_tokens)
    if limits is not None:  # refuse what cannot fit before anything is sent (the replica checks exactly)
        at_least = len(prompt) if isinstance(prompt, list) else len(prompt.encode("utf-8")) // limits.max_token_bytes
        check_context(at_least, sp.max_tokens, limits, "prompt")
    return GenerateRequest(
        request_id=rid, sampling=sp, stream=body.stream, echo=body.echo,
        prompt=prompt if isinstance(prompt, str) else None, prompt_ids=prompt if isinstance(prompt, list) else None,
        return_logprobs=body.logprobs is not None, top_logprobs=body.logprobs or 0,
    )


async def _one(state: GatewayState, gen: GenerateRequest, n: int) -> list[GenerateResponse]:
    """The ``n`` choices of one prompt."""
    resps = await generate_all(state.llms, fan_out(gen, pack_raw({}, gen), n))
    if any(r.finish_reason == "abort" for r in resps):
        raise UpstreamError(ABORTED, status=503)
    return resps


async def _open(state: GatewayState, gen: GenerateRequest, n: int) -> ChoiceStreams:
    return ChoiceStreams(await open_all(state.llms, fan_out(gen, pack_raw({}, gen), n)))


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: StateDep) -> Response:
    check_model(body.model, state.model_name)
    check_completion_prompts(body, state.settings)  # before one generation request is built
    check_grammar_size(body, state.settings)
    cid, created, start = completion_id("cmpl"), now(), time.monotonic()
    gens = [_generate_request(state, body, p, f"{cid}-{i}") for i, p in enumerate(body.prompts())]
    logprobs = body.logprobs is not None
    echo_top = body.logprobs if body.echo else None  # echo with logprobs: the prompt's lead them

    async def plain() -> dict:
        per_prompt = await asyncio.gather(*(_one(state, g, body.n) for g in gens))
        return text_completion([r for rs in per_prompt for r in rs], body.model, cid, created, logprobs,
                               n=body.n, echo_top=echo_top, prompt_top=body.prompt_logprobs_field()).model_dump()

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await answer(request, state, cid, start, body.stream, plain,
                        lambda: _open(state, gens[0], body.n),
                        CompletionChunkWriter(cid, created, body.model, include_usage, logprobs, echo_top or 0))
