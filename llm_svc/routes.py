"""HTTP routes: POST /v1/generate (JSON or NDJSON stream), /healthz, /readyz, /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from shared.schemas import GenerateChunk, GenerateRequest, GenerateResponse, HealthStatus
from shared.wire import WireError, unpack

from .backends import BackendStats, GenOutput, RequestStream
from .errors import InvalidRequest, error_body
from .prompt import prepare_request
from .types import PreparedRequest
from .state import ServiceState

router = APIRouter()
NDJSON = "application/x-ndjson"
DISCONNECT_POLL_S = 0.1


def get_state(request: Request) -> ServiceState:
    return request.app.state.svc


StateDep = Annotated[ServiceState, Depends(get_state)]


def _error(state: ServiceState, status: int, message: str, param: str | None = None, code: str | None = None,
           type_: str = "invalid_request_error") -> JSONResponse:
    state.metrics.rejected.labels(status=str(status)).inc()
    return JSONResponse(status_code=status, content=error_body(message, type_, param, code))


@router.get("/healthz")
async def healthz(state: StateDep) -> JSONResponse:
    """Liveness: 500 once loading failed, so an orchestrator restarts the service."""
    status = "error" if state.error else "ok"
    body = HealthStatus(status=status, service="llm", model=state.model_name, detail=state.error)
    return JSONResponse(body.model_dump(), status_code=500 if state.error else 200)


@router.get("/readyz")
async def readyz(state: StateDep) -> JSONResponse:
    if state.ready:
        body = HealthStatus(status="ok", service="llm", model=state.model_name)
        return JSONResponse(body.model_dump())
    status = "error" if state.error else "loading"
    body = HealthStatus(status=status, service="llm", model=state.model_name, detail=state.not_ready_detail)
    return JSONResponse(body.model_dump(), status_code=503)


@router.get("/metrics")
async def metrics(state: StateDep) -> Response:
    stats = state.backend.stats() if state.backend else BackendStats()
    return Response(state.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)


class _Tracker:
    """Per-request metrics: TTFT on the first token, counts on the final output."""

    def __init__(self, state: ServiceState):
        self.state = state
        self.t0 = time.monotonic()
        self.first = True

    def see(self, out: GenOutput) -> None:
        m = self.state.metrics
        if self.first and out.token_ids:
            self.first = False
            m.ttft.observe(time.monotonic() - self.t0)
        if out.final:
            m.requests.labels(finish_reason=out.finish_reason or "error").inc()
            m.prompt_tokens.inc(out.prompt_tokens)
            m.generation_tokens.inc(out.completion_tokens)
            m.prefix_hit_tokens.inc(out.cached_tokens)
            m.e2e.observe(time.monotonic() - self.t0)


@router.post("/v1/generate")
async def generate(request: Request, state: StateDep):
    if not state.ready or state.prep is None:
        return _error(state, 503, f"the model is not serving ({state.not_ready_detail}); retry later",
                      type_="service_unavailable")
    body = await request.body()
    try:  # unpacking and tokenizing run on worker threads: the event loop keeps answering
        prep = await state.prep.run(_prepare, body, state.settings.max_model_len)
    except WireError as e:
        return _error(state, 400, f"the body must be shared.wire.pack(tensors, GenerateRequest) bytes: {e}",
                      param="body")
    except InvalidRequest as e:
        return _error(state, 400, e.message, e.param, e.code)
    if not state.ready:
        return _error(state, 503, f"the model is not serving ({state.not_ready_detail}); retry later",
                      type_="service_unavailable")
    if prep.request_id in state.in_flight:
        return _error(state, 400, f"request_id {prep.request_id!r} is already in flight; use a unique id",
                      param="request_id")
    try:
        stream = state.backend.submit(prep)
    except InvalidRequest as e:
        if e.code == "engine_unavailable":
            return _error(state, 503, e.message, type_="service_unavailable")
        return _error(state, 400, e.message, e.param, e.code)
    state.in_flight.add(prep.request_id)
    if prep.stream:
        return StreamingResponse(_ndjson(state, prep, stream), media_type=NDJSON)
    return await _collect(request, state, prep, stream)


# JSON may spend up to 6 bytes on one byte of text (``\\u0001``); the rest of a header is a few
# hundred bytes per message, each message rendering at least one token
_JSON_BYTES_PER_TEXT_BYTE = 6
_HEADER_SLACK = 1 << 20


def _prepare(lm, body: bytes, max_model_len: int) -> PreparedRequest:
    # a header far longer than any prompt that fits is refused before it is parsed (parsing
    # 8 MB of JSON holds the GIL for tens of milliseconds)
    header_bytes = int.from_bytes(body[:8], "little") if len(body) >= 8 else 0
    limit = _JSON_BYTES_PER_TEXT_BYTE * lm.max_token_bytes * max_model_len + _HEADER_SLACK
    if header_bytes > limit:
        raise InvalidRequest(
            f"the request header is {header_bytes} bytes: its prompt cannot fit max_model_len={max_model_len} "
            "tokens; shorten the prompt", param="messages", code="context_length_exceeded")
    tensors, req = unpack(body, GenerateRequest)
    return prepare_request(lm, req, tensors, max_model_len)


async def _ndjson(state: ServiceState, prep: PreparedRequest, stream: RequestStream) -> AsyncIterator[bytes]:
    tracker = _Tracker(state)
    finished = False
    try:
        async for out in stream:
            tracker.see(out)
            chunk = GenerateChunk(request_id=prep.request_id, text=out.text, token_ids=out.token_ids)
            if out.final:
                finished = True
                chunk.finish_reason = out.finish_reason or "abort"
                chunk.error = out.error
                chunk.prompt_tokens = out.prompt_tokens
                chunk.completion_tokens = out.completion_tokens
                chunk.cached_tokens = out.cached_tokens
            yield (chunk.model_dump_json(exclude_none=True) + "\n").encode()
    finally:  # the client went away (the generator was cancelled/closed) -> free everything
        if not finished:
            state.backend.abort(prep.request_id)
            task = asyncio.create_task(_drain(state, prep, stream, tracker))
            _draining.add(task)
            task.add_done_callback(_draining.discard)
        else:
            state.in_flight.discard(prep.request_id)


_draining: set[asyncio.Task] = set()


async def _drain(state: ServiceState, prep: PreparedRequest, stream: RequestStream, tracker: "_Tracker") -> None:
    """Read an abandoned stream to its end so its metrics record how it really finished."""
    try:
        async for out in stream:
            tracker.see(out)
    finally:
        state.in_flight.discard(prep.request_id)


async def _collect(request: Request, state: ServiceState, prep: PreparedRequest, stream: RequestStream):
    tracker = _Tracker(state)
    text: list[str] = []
    ids: list[int] = []
    logprobs: list[float] = []
    final: GenOutput | None = None

    async def consume() -> None:
        nonlocal final
        async for out in stream:
            tracker.see(out)
            text.append(out.text)
            ids.extend(out.token_ids)
            logprobs.extend(out.logprobs)
            if out.final:
                final = out

    task = asyncio.create_task(consume())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                state.backend.abort(prep.request_id)
                await task  # the stream ends with finish_reason=abort
        await task
    finally:
        if not task.done():  # our handler was cancelled
            state.backend.abort(prep.request_id)
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        state.in_flight.discard(prep.request_id)
    assert final is not None
    if final.error:
        if final.error_status < 500:
            return _error(state, final.error_status, final.error)
        type_ = "service_unavailable" if final.error_status == 503 else "server_error"
        return _error(state, final.error_status, final.error, type_=type_)
    return GenerateResponse(
        request_id=prep.request_id,
        text="".join(text),
        token_ids=ids,
        finish_reason=final.finish_reason,
        prompt_tokens=final.prompt_tokens,
        completion_tokens=final.completion_tokens,
        cached_tokens=final.cached_tokens,
        logprobs=logprobs if prep.return_logprobs else None,
    )
