"""``POST /v1/chat/completions``: media fetched and encoded concurrently, then one generation on
an LLM replica, answered as JSON or as SSE.  The client leaving cancels everything upstream."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gateway.edge.auth import ApiKeyDep
from gateway.errors import APIError
from gateway.media.items import MediaItem, collect_media
from gateway.openai_api.answer_format import SSE_DONE, ChunkWriter, CompletionChunkWriter, chat_completion, completion_id, now
from gateway.pipeline.prompt import build_generate_request, pack_generate
from gateway.state import GatewayState, StateDep
from gateway.pipeline.choices import ChoiceStreams, fan_out, generate_all, open_all
from gateway.openai_api.requests import ChatCompletionRequest
from gateway.edge.limits import TICKET_SCOPE_KEY
from gateway.openai_api.request_limits import check_chat_limits
from gateway.upstream import MediaUnavailable, UpstreamError, upstream_deadline
from gateway.openai_api.validate import check_fits, check_model, check_template, check_text
from shared.schemas import GenerateChunk, GenerateRequest, GenerateResponse
from shared.admission import Overloaded, Ticket
from shared.streaming import ClosingStreamingResponse, race_disconnect

log = logging.getLogger("mmserve.gateway.chat")
router = APIRouter(dependencies=[ApiKeyDep])
T = TypeVar("T")

CLIENT_CLOSED = 499  # nginx's "client closed request"


ABORTED = "the LLM service aborted the generation (it is shutting down or restarting); retry the request"


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


async def until_disconnect(request: Request, work: Awaitable[T], timeout: float) -> T:
    """``await work``, cancelling it if the client disconnects or ``timeout`` s pass first."""
    task = asyncio.ensure_future(work)
    returned = False
    try:
        first = await race_disconnect(request, task, max(0.0, timeout))
        if first == "done":
            returned = True
            return task.result()
        if first == "gone":
            raise ClientGone()
        raise UpstreamError(f"request timed out after {timeout:g}s", status=504)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        elif not returned and not task.cancelled() and task.exception() is None:
            # finished in the same instant we gave up: release what it opened (an LLM stream)
            aclose = getattr(task.result(), "aclose", None)
            if aclose is not None:
                await aclose()


async def prepare(
    state: GatewayState, body: ChatCompletionRequest, cid: str
) -> tuple[GenerateRequest, bytes, list[MediaItem]]:
    """Media fetched, encoded (all items concurrently) and packed with the prompt; by reference
    unless ``media_by_ref`` is off."""
    s = state.settings
    check_fits(body, s.default_max_tokens, state.llm_limits.best())  # before any fetch or encode
    refs = collect_media(body, s.max_media_items)
    for ref in refs:
        state.metrics.media_items.labels(ref.modality).inc()
    items = await state.fetcher.load(refs, s.max_request_media_bytes)
    gen, packed = await _encode_and_pack(state, body, cid, items, s.media_by_ref)
    return gen, packed, items


async def _encode_and_pack(state: GatewayState, body: ChatCompletionRequest, cid: str, items: list[MediaItem],
                           by_ref: bool) -> tuple[GenerateRequest, bytes]:
    encoded = await state.encoders.encode_all(items, by_ref=by_ref)
    gen = build_generate_request(body, encoded, cid, state.settings.default_max_tokens)
    packed = pack_generate(gen, encoded)
    for e in encoded:
        state.metrics.media_sent.labels("ref" if e.by_ref else "value").inc()
    state.metrics.llm_body_bytes.inc(len(packed))
    return gen, packed


async def by_value(state: GatewayState, body: ChatCompletionRequest, cid: str, items: list[MediaItem],
                   err: MediaUnavailable) -> tuple[GenerateRequest, bytes]:
    """The LLM could not fetch what was sent by reference (evicted, encoder restarted): encode
    again (a cache hit where it is still there) and send the tensors this time."""
    log.info("%s: %s; re-sending the media by value", cid, err.message)
    state.metrics.media_resends.inc()
    return await _encode_and_pack(state, body, cid, items, by_ref=False)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: StateDep) -> Response:
    check_text(body)  # before anything may echo a string back
    check_template(body.chat_template_kwargs, state.settings.trust_request_chat_template)
    check_chat_limits(body, state.settings)
    check_model(body.model, state.model_name)
    cid, created, start = completion_id(), now(), time.monotonic()
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def plain() -> dict:
        return chat_completion(await _generate(state, body, cid), body.model, cid, created,
                               prompt_top=body.prompt_logprobs_wanted()).model_dump()

    return await answer(request, state, cid, start, body.stream, plain, lambda: _open(state, body, cid),
                        ChunkWriter(cid, created, body.model, include_usage))


async def answer(request: Request, state: GatewayState, cid: str, start: float, stream: bool,
                 plain: Callable[[], Awaitable[dict]], open_stream: Callable[[], Awaitable[ChoiceStreams]],
                 writer: ChunkWriter | CompletionChunkWriter) -> Response:
    """One admitted generation answered as JSON (``plain()``'s body) or as SSE from
    ``open_stream()``; cancelled if the client leaves, bounded by the request timeout (carried
    to the encoders and the LLM as a deadline)."""
    timeout = state.settings.request_timeout
    upstream_deadline.set(start + timeout)  # copied into the tasks below
    # taken before the body was read (gateway.edge.limits.AdmissionMiddleware), else here
    ticket = request.scope.get(TICKET_SCOPE_KEY) or await admit(state)
    opened = False  # once a stream is open, the response's close releases the ticket
    try:
        if not stream:
            return JSONResponse(await until_disconnect(request, plain(), timeout))
        llm = await until_disconnect(request, open_stream(), timeout - (time.monotonic() - start))
        opened = True
    except ClientGone:
        log.info("%s: client disconnected before the answer", cid)
        return Response(status_code=CLIENT_CLOSED)
    finally:
        if not opened:
            ticket.release()

    async def close() -> None:  # runs even if the client left before the first byte
        ticket.release()
        await llm.aclose()

    return ClosingStreamingResponse(
        sse_events(llm, writer, state, start),
        on_close=close,
        media_type="text/event-stream",
        headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
    )


async def admit(state: GatewayState) -> Ticket:
    """A slot of the gateway's admission gate, or a 429 with ``Retry-After``."""
    try:
        return await state.admission.acquire()
    except Overloaded as e:
        state.metrics.rejected.labels("gateway").inc()
        raise APIError(429, e.message, code="overloaded", headers={"Retry-After": str(e.retry_after)}) from None


async def _generate(state: GatewayState, body: ChatCompletionRequest, cid: str) -> list[GenerateResponse]:
    """One answer per choice (``n``)."""
    gen, packed, items = await prepare(state, body, cid)
    try:
        resps = await generate_all(state.llms, fan_out(gen, packed, body.n))
    except MediaUnavailable as e:
        gen, packed = await by_value(state, body, cid, items, e)
        resps = await generate_all(state.llms, fan_out(gen, packed, body.n))
    if any(r.finish_reason == "abort" for r in resps):
        raise UpstreamError(ABORTED, status=503)
    return resps


async def _open(state: GatewayState, body: ChatCompletionRequest, cid: str) -> ChoiceStreams:
    gen, packed, items = await prepare(state, body, cid)
    try:  # the LLM answers a by-reference stream's headers once its media is resolved
        return ChoiceStreams(await open_all(state.llms, fan_out(gen, packed, body.n)))
    except MediaUnavailable as e:
        gen, packed = await by_value(state, body, cid, items, e)
        return ChoiceStreams(await open_all(state.llms, fan_out(gen, packed, body.n)))


async def sse_events(
    stream: ChoiceStreams, writer: ChunkWriter | CompletionChunkWriter, state: GatewayState, start: float
) -> AsyncIterator[bytes]:
    """Opening events (chat: the role chunk of each choice), content deltas, a finish chunk per
    choice, the usage chunk (if asked: the prompt once, every choice's completion tokens),
    ``[DONE]``; an upstream failure mid-stream becomes an ``error`` event. Closing the generator
    closes upstream. Chat and text completions alike (``writer`` makes their shapes)."""
    first_token = True
    finished: dict[int, GenerateChunk] = {}
    out: list[bytes] = []  # the events of one batch of chunks (or of the end): one write each
    try:
        for i in range(stream.n):
            for event in writer.opening(i):
                yield event
        async with aclosing(stream.batches()) as batches:
            ended = False
            async for batch in batches:
                for i, chunk in batch:
                    if chunk.error:
                        out.append(writer.error(f"generation failed: {chunk.error}"))
                        ended = True
                        break
                    if chunk.text or chunk.token_logprobs or chunk.reasoning or chunk.tool_calls or chunk.prompt_logprobs:
                        if first_token:
                            state.metrics.ttft.observe(time.monotonic() - start)
                            first_token = False
                        out.append(writer.content(chunk.text, chunk.token_logprobs, chunk.reasoning, chunk.tool_calls,
                                                  index=i, prompt_logprobs=chunk.prompt_logprobs))
                    if chunk.finish_reason == "abort":
                        out.append(writer.error(ABORTED))
                        ended = True
                        break
                    if chunk.finish_reason is not None:
                        out.append(writer.finish(chunk.finish_reason, index=i))
                        finished[i] = chunk
                        if len(finished) == stream.n:
                            ended = True
                            break
                if ended:
                    break
                if out:
                    yield b"".join(out)
                    out.clear()
            if not ended:
                out.append(writer.error("generation ended without a finish reason"))
        if len(finished) == stream.n and writer.include_usage:
            first = finished[0]
            out.append(writer.usage(first.prompt_tokens or 0, sum(c.completion_tokens or 0 for c in finished.values()),
                                    first.cached_tokens or 0))
        out.append(SSE_DONE)
        yield b"".join(out)
    except UpstreamError as e:
        yield b"".join(out) + writer.error(e.message) + SSE_DONE
    finally:
        await stream.aclose()
