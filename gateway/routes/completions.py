"""``POST /v1/completions`` (OpenAI's legacy text completions, as vLLM serves them): a prompt
string or token ids, or a batch of them (one choice each), on an LLM replica; JSON or SSE."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gateway.auth import ApiKeyDep
from gateway.errors import APIError
from gateway.openai_format import SSE_DONE, CompletionChunkWriter, now, text_completion
from gateway.prompt import sampling_params
from gateway.routes.chat import ABORTED, CLIENT_CLOSED, ClientGone, admit, until_disconnect
from gateway.state import GatewayState, StateDep
from gateway.upstream import LLMStream, UpstreamError, upstream_deadline
from shared.rawwire import pack_raw
from shared.schemas import CompletionRequest, GenerateRequest, GenerateResponse
from shared.streaming import ClosingStreamingResponse

log = logging.getLogger("mmserve.gateway.completions")
router = APIRouter(dependencies=[ApiKeyDep])


def completion_id() -> str:
    import uuid

    return f"cmpl-{uuid.uuid4().hex}"


def _generate_request(state: GatewayState, body: CompletionRequest, prompt: str | list[int], rid: str) -> GenerateRequest:
    limits = state.llm_limits.best()
    sp = sampling_params(body, state.settings.default_max_tokens)
    if limits is not None:  # refuse what cannot fit before anything is sent (the replica checks exactly)
        at_least = len(prompt) if isinstance(prompt, list) else len(prompt.encode("utf-8")) // limits.max_token_bytes
        if at_least + sp.max_tokens > limits.max_model_len:
            raise APIError(400, f"the prompt has at least {at_least} tokens and max_tokens is {sp.max_tokens}: together "
                           f"they exceed the model's context of {limits.max_model_len} tokens; shorten the prompt or "
                           "lower max_tokens", param="prompt", code="context_length_exceeded")
    return GenerateRequest(
        request_id=rid, sampling=sp, stream=body.stream, echo=body.echo,
        prompt=prompt if isinstance(prompt, str) else None, prompt_ids=prompt if isinstance(prompt, list) else None,
        return_logprobs=body.logprobs is not None, top_logprobs=body.logprobs or 0,
    )


async def _one(state: GatewayState, gen: GenerateRequest) -> GenerateResponse:
    resp = await state.llms.generate(gen, pack_raw({}, gen))
    if resp.finish_reason == "abort":
        raise UpstreamError(ABORTED, status=503)
    return resp


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: StateDep) -> Response:
    if body.model != state.settings.model_name:
        raise APIError(404, f"The model `{body.model}` does not exist", param="model", code="model_not_found")
    cid, created, start = completion_id(), now(), time.monotonic()
    timeout = state.settings.request_timeout
    upstream_deadline.set(start + timeout)
    gens = [_generate_request(state, body, p, f"{cid}-{i}") for i, p in enumerate(body.prompts())]
    ticket = await admit(state)
    opened = False
    try:
        if not body.stream:
            work = asyncio.gather(*(_one(state, g) for g in gens))
            resps = await until_disconnect(request, work, timeout)
            return JSONResponse(text_completion(list(resps), body.model, cid, created, body.logprobs is not None)
                                .model_dump())
        gen = gens[0]
        stream = await until_disconnect(request, state.llms.open_stream(gen, pack_raw({}, gen)), timeout)
        opened = True
    except ClientGone:
        log.info("%s: client disconnected before the answer", cid)
        return Response(status_code=CLIENT_CLOSED)
    finally:
        if not opened:
            ticket.release()
    writer = CompletionChunkWriter(cid, created, body.model, bool(body.stream_options and body.stream_options.include_usage),
                                   body.logprobs is not None)

    async def close() -> None:
        ticket.release()
        await stream.aclose()

    return ClosingStreamingResponse(_events(stream, writer, state, start), on_close=close, media_type="text/event-stream",
                                    headers={"cache-control": "no-cache", "x-accel-buffering": "no"})


async def _events(stream: LLMStream, writer: CompletionChunkWriter, state: GatewayState,
                  start: float) -> AsyncIterator[bytes]:
    first = True
    try:
        async with aclosing(stream.chunks()) as chunks:
            async for chunk in chunks:
                if chunk.error:
                    yield writer.error(f"generation failed: {chunk.error}")
                    break
                if chunk.text or chunk.token_logprobs:
                    if first:
                        state.metrics.ttft.observe(time.monotonic() - start)
                        first = False
                    yield writer.content(chunk.text, chunk.token_logprobs)
                if chunk.finish_reason == "abort":
                    yield writer.error(ABORTED)
                    break
                if chunk.finish_reason is not None:
                    yield writer.finish(chunk.finish_reason)
                    if writer.include_usage:
                        yield writer.usage(chunk.prompt_tokens or 0, chunk.completion_tokens or 0, chunk.cached_tokens or 0)
                    break
            else:
                yield writer.error("generation ended without a finish reason")
        yield SSE_DONE
    except UpstreamError as e:
        yield writer.error(e.message)
        yield SSE_DONE
    finally:
        await stream.aclose()
