"""HTTP routes: POST /v1/generate (JSON or NDJSON stream), /healthz, /readyz, /metrics.

Media by reference: a backend that ``fetches_media`` gets the request as is (it fetches what its
prefix cache misses); for any other the items are fetched here first. A stream with media by
reference answers its headers once the first output is out, so that media no encoder has any
more is a plain 409 ``media_unavailable`` the gateway can retry by value, never a broken stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from shared.admission import Overloaded, Ticket, deadline_from
from shared.bounded_read import TooLarge, read_bounded
from shared.kv_events import SNAPSHOT_PATH
from shared.schemas import GenerateChunk, GenerateRequest, GenerateResponse, HealthStatus, ServiceLimits
from shared.settings import length_bucket_range
from shared.streaming import ClosingStreamingResponse, race_disconnect
from shared.wire import WireError, unpack

from llm_svc.backends import BackendStats, GenOutput, RequestStream
from llm_svc.types.errors import InvalidRequest, error_body
from llm_svc.core.media_fetch import MEDIA_UNAVAILABLE, MediaUnavailable
from .output_shape import merge_calls
from .prompt import prepare_request
from llm_svc.disagg.transport import handover_address
from .remote_prefill import check_peer, check_transfer, remote_prefill
from llm_svc.types.request import PreparedRequest
from .state import ServiceState

router = APIRouter()
NDJSON = "application/x-ndjson"


async def get_state(request: Request) -> ServiceState:
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
async def readyz(state: StateDep, request: Request) -> JSONResponse:
    # what this replica leaves open (no service token beyond loopback), naming the setting
    warnings = {"warnings": getattr(request.app.state, "exposure_warnings", [])}
    kernels = getattr(request.app.state, "kernels", None)
    if kernels is not None:  # which C kernels this replica loads (None until the report is made)
        warnings["kernels"] = kernels.report()
    if state.ready:
        limits = None
        if state.lm is not None:
            lo, hi = (0, None) if not state.settings.length_bucket else length_bucket_range(state.settings.length_bucket)
            limits = ServiceLimits(max_model_len=state.settings.max_model_len, max_token_bytes=state.lm.max_token_bytes,
                                   min_prompt_tokens=lo, max_prompt_tokens=hi)
        body = HealthStatus(status="ok", service="llm", model=state.model_name, limits=limits,
                            kv_instance=state.kv_events.instance if state.kv_events is not None else None,
                            speculative_config=state.spec.to_dict() if state.spec is not None else None)
        role = {"role": state.settings.role}
        port = state.backend.handover_port()
        if port:  # role decode: where prefill replicas send this replica's hand-overs
            role["handover"] = {"host": handover_address(state.settings.handover_host)[1], "port": port}
        return JSONResponse({**body.model_dump(), **role, **warnings})
    status = "error" if state.error else "loading"
    body = HealthStatus(status=status, service="llm", model=state.model_name, detail=state.not_ready_detail)
    return JSONResponse({**body.model_dump(), **warnings}, status_code=503)


@router.get(SNAPSHOT_PATH)
async def kv_snapshot(state: StateDep) -> JSONResponse:
    """The router keys this replica's prefix tree holds, as of KV event ``seq``."""
    if state.kv_events is None:
        return JSONResponse(error_body("this replica publishes no KV events (kv_events_url unset)"), status_code=404)
    return JSONResponse(state.kv_events.snapshot().model_dump())


@router.get("/metrics")
async def metrics(state: StateDep, request: Request) -> Response:
    kernels = getattr(request.app.state, "kernels", None)
    if kernels is not None:
        kernels.start()  # mmserve_llm_kernel_loaded once the report is made
    stats = state.backend.stats() if state.backend else BackendStats()
    return Response(state.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)


class _Tracker:
    """Per-request metrics: TTFT on the first token, the gap before each later token (ITL),
    counts on the final output."""

    def __init__(self, state: ServiceState):
        self.state = state
        self.t0 = time.monotonic()
        self.first = True
        self.last = self.t0

    def see(self, out: GenOutput) -> None:
        m = self.state.metrics
        if out.token_ids:
            now = time.monotonic()
            if self.first:
                self.first = False
                m.ttft.observe(now - self.t0)
            else:
                for _ in out.token_ids:  # an increment of k tokens: k gaps of (now - last) / k
                    m.itl.observe((now - self.last) / len(out.token_ids))
            self.last = now
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
    deadline = deadline_from(request.headers)
    if deadline is not None and deadline <= time.monotonic():
        state.metrics.deadline_drops.inc()
        return _error(state, 504, "the request's deadline passed before it arrived; not started",
                      type_="timeout_error")
    try:
        ticket = await state.admission.acquire()
    except Overloaded as e:
        resp = _error(state, 429, e.message, code="overloaded", type_="rate_limit_error")
        resp.headers["Retry-After"] = str(e.retry_after)
        return resp
    streaming = False  # a stream releases its ticket when it ends (release is idempotent)
    try:
        resp = await _admitted(request, state, ticket, deadline)
        streaming = isinstance(resp, ClosingStreamingResponse)
        return resp
    finally:
        if not streaming:
            ticket.release()


async def _admitted(request: Request, state: ServiceState, ticket: Ticket, deadline: float | None):
    body = await _read_body(request, state.settings.max_request_bytes)
    if isinstance(body, JSONResponse):
        state.metrics.rejected.labels(status="413").inc()
        return body
    try:  # unpacking and tokenizing run on worker threads: the event loop keeps answering
        prep = await state.prep.run(_prepare, body, state.settings.max_model_len,
                                     state.settings.trust_request_chat_template)
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
    if prep.unresolved() and not state.backend.fetches_media:
        failed = await _fetch_all(state, prep)
        if failed is not None:
            return failed
    if prep.kv_transfer is not None:  # prefill / decode disaggregation (docs/disagg.md)
        asked = prep.kv_transfer.do_remote_prefill
        try:
            remote = check_transfer(state.settings.role, prep)
            await check_peer(state.kv_peers, prep)
        except InvalidRequest as e:
            return _error(state, 400, e.message, e.param, e.code)
        if remote:
            prep.remote = await remote_prefill(state, prep, body)
        elif asked:
            state.metrics.remote_prefill.labels("fallback_unsupported").inc()
    try:
        stream = state.backend.submit(prep)
    except InvalidRequest as e:
        if e.code == "engine_unavailable":
            return _error(state, 503, e.message, type_="service_unavailable")
        return _error(state, 400, e.message, e.param, e.code)
    state.live[prep.request_id] = _Live(ticket, _deadline_timer(state, prep.request_id, deadline))
    if prep.stream:
        out = _NdjsonStream(state, prep, stream)
        # media to fetch, a grammar to compile, a KV pool smaller than max_model_len (the engine's
        # capacity check): each can still fail as a 4xx, before any byte
        if prep.unresolved() or prep.sampling.structured is not None or _pool_below_context(state):
            try:
                first = await _peek(request, stream)
            except BaseException:
                await out.close()
                raise
            if first is None:  # the client left
                await out.close()
                return Response(status_code=499)
            if first.error_code == MEDIA_UNAVAILABLE or (first.error and 400 <= first.error_status < 500):
                out.finished = True
                await out.close()
                return _error(state, first.error_status, first.error, code=first.error_code)
            out.first = first
            out.finished = first.final  # nothing left to drain if it is the last one
        # on_close: a client gone before the first byte never starts the generator
        return ClosingStreamingResponse(out.lines(), on_close=out.close, media_type=NDJSON)
    return await _collect(request, state, prep, stream)


def _pool_below_context(state: ServiceState) -> bool:
    """The backend's KV pool holds fewer tokens than ``max_model_len`` (a setting above it): a
    request that passed the length check may still be refused by the engine."""
    held = state.backend.max_sequence_tokens()
    return held is not None and held < state.settings.max_model_len


async def _fetch_all(state: ServiceState, prep: PreparedRequest) -> JSONResponse | None:
    """Every item sent by reference, fetched for a backend without a prefix cache of its own."""
    try:
        got = await state.media.fetch_many({i: prep.mm_refs[i] for i in prep.unresolved()})
    except MediaUnavailable as e:
        return _error(state, e.status, e.message, code=e.code)
    for i, t in got.items():
        prep.mm_items[i] = t.to(device=state.lm.device, dtype=state.lm.dtype)
    return None


async def _peek(request: Request, stream: RequestStream) -> GenOutput | None:
    """The stream's first output (its media resolved), or None if the client left first."""
    task = asyncio.ensure_future(stream.__anext__())
    try:
        return task.result() if await race_disconnect(request, task) == "done" else None
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


class _Live:
    """What a submitted request holds until it ends: its admission ticket and deadline timer."""

    __slots__ = ("ticket", "timer", "expired")

    def __init__(self, ticket: Ticket, timer: asyncio.TimerHandle | None) -> None:
        self.ticket, self.timer, self.expired = ticket, timer, False


def _deadline_timer(state: ServiceState, rid: str, deadline: float | None) -> asyncio.TimerHandle | None:
    """Aborts ``rid`` when its deadline passes (the loop's clock is ``time.monotonic``)."""
    if deadline is None:
        return None

    def expire() -> None:
        live = state.live.get(rid)
        if live is not None and not live.expired:
            live.expired = True
            state.metrics.deadline_drops.inc()
            state.backend.abort(rid)

    return asyncio.get_running_loop().call_at(deadline, expire)


def _expired(state: ServiceState, rid: str) -> bool:
    live = state.live.get(rid)
    return live is not None and live.expired


def _release(state: ServiceState, rid: str) -> None:
    """The request ended: its id, admission slot and timer are free."""
    live = state.live.pop(rid, None)
    if live is not None:
        if live.timer is not None:
            live.timer.cancel()
        live.ticket.release()


async def _read_body(request: Request, limit: int) -> bytes | JSONResponse:
    """The body, or a 413 as soon as it is known to exceed ``limit`` (never buffered past it)."""
    try:
        return await read_bounded(request.stream(), limit, request.headers.get("content-length"))
    except TooLarge:
        return JSONResponse(status_code=413, content=error_body(
            f"the request body exceeds {limit} bytes (MMSERVE_LLM_MAX_REQUEST_BYTES); send a shorter prompt "
            "or fewer media", param="body", code="request_too_large"))


# The header is JSON inside the safetensors metadata's JSON, so a byte of text may take 7 bytes
# (``\\\\u0001``), but only where it is escaped, and every escape starts with a backslash: the
# decoded text is at least the header's bytes less 6 per backslash in them (an escape of either
# level, ``\\X`` or ``\\uXXXX``, loses at most 5 bytes, its backslash doubled in the outer level
# one more), less the slack for what is not prompt (sampling, schemas: at most a few hundred KB;
# messages' own JSON renders at least a token each, never 256 bytes of it)
_ESCAPE_LOSS = 6  # (and so at most 7 header bytes a text byte, escapes or not)
_HEADER_SLACK = 1 << 20


def _prepare(lm, body: bytes, max_model_len: int, trust_template: bool = False) -> PreparedRequest:
    # a header far longer than any prompt that fits is refused before it is parsed (parsing
    # 8 MB of JSON holds the GIL for tens of milliseconds)
    header_bytes = int.from_bytes(body[:8], "little") if len(body) >= 8 else 0
    json_bytes = header_bytes - _HEADER_SLACK
    text_at_least = max(json_bytes // (_ESCAPE_LOSS + 1), json_bytes - _ESCAPE_LOSS * body.count(b"\\", 8, 8 + header_bytes))
    if text_at_least > lm.max_token_bytes * max_model_len:  # no token holds more bytes than the longest
        raise InvalidRequest(
            f"the request header is {header_bytes} bytes: its prompt cannot fit max_model_len={max_model_len} "
            "tokens; shorten the prompt", param="messages", code="context_length_exceeded")
    tensors, req = unpack(body, GenerateRequest)
    return prepare_request(lm, req, tensors, max_model_len, trust_template)


class _NdjsonStream:
    """One streamed generation: ``lines()`` is the body; ``close()`` (idempotent) aborts an
    unfinished generation and releases the request id once its stream has drained."""

    def __init__(self, state: ServiceState, prep: PreparedRequest, stream: RequestStream) -> None:
        self.state, self.prep, self.stream = state, prep, stream
        self.tracker = _Tracker(state)
        self.finished = False
        self.closed = False
        self.first: GenOutput | None = None  # an output already read (``_peek``), sent first
        self.echoed = False

    def _line(self, out: GenOutput) -> bytes:
        self.tracker.see(out)
        text = out.text
        if self.prep.echo_text and not self.echoed:  # completions' echo: the prompt's text leads
            text, self.echoed = self.prep.echo_text + text, True
        chunk = GenerateChunk(request_id=self.prep.request_id, text=text, token_ids=out.token_ids,
                              token_logprobs=out.token_logprobs or None, prompt_logprobs=out.prompt_logprobs)
        reason = (out.finish_reason or "abort") if out.final else None
        if self.prep.shaper is not None and not out.error:
            shaped = self.prep.shaper.shape(out.token_ids, text, reason)
            chunk.text, chunk.reasoning, chunk.tool_calls = shaped.content, shaped.reasoning, shaped.tool_calls
            reason = shaped.finish_reason
        if out.final:
            self.finished = True
            chunk.finish_reason = reason
            chunk.error = out.error
            if _expired(self.state, self.prep.request_id):
                chunk.error = "the request's deadline passed; generation stopped"
            chunk.prompt_tokens = out.prompt_tokens
            chunk.completion_tokens = out.completion_tokens
            chunk.cached_tokens = out.cached_tokens
        return (chunk.model_dump_json(exclude_none=True) + "\n").encode()

    async def lines(self) -> AsyncIterator[bytes]:
        try:
            if self.first is not None:
                yield self._line(self.first)
                if self.first.final:
                    return
            async for out in self.stream:  # what is queued behind it goes in the same write
                yield b"".join([self._line(o) for o in (out, *self.stream.ready())])
        finally:  # the client went away (the generator was cancelled/closed) -> free everything
            await self.close()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.finished:
            _release(self.state, self.prep.request_id)
            return
        self.state.backend.abort(self.prep.request_id)
        task = asyncio.create_task(_drain(self.state, self.prep, self.stream, self.tracker))
        _draining.add(task)
        task.add_done_callback(_draining.discard)


_draining: set[asyncio.Task] = set()


async def _drain(state: ServiceState, prep: PreparedRequest, stream: RequestStream, tracker: "_Tracker") -> None:
    """Read an abandoned stream to its end so its metrics record how it really finished."""
    try:
        async for out in stream:
            tracker.see(out)
    finally:
        _release(state, prep.request_id)


async def _collect(request: Request, state: ServiceState, prep: PreparedRequest, stream: RequestStream):
    tracker = _Tracker(state)
    text: list[str] = [prep.echo_text]
    ids: list[int] = []
    logprobs: list[float] = []
    token_logprobs: list = []
    prompt_logprobs: list | None = None
    final: GenOutput | None = None

    async def consume() -> None:
        nonlocal final, prompt_logprobs
        async for out in stream:
            tracker.see(out)
            text.append(out.text)
            ids.extend(out.token_ids)
            logprobs.extend(out.logprobs)
            token_logprobs.extend(out.token_logprobs)
            if out.prompt_logprobs is not None:
                prompt_logprobs = out.prompt_logprobs
            if out.final:
                final = out

    task = asyncio.create_task(consume())
    try:
        if await race_disconnect(request, task) == "gone":
            state.backend.abort(prep.request_id)
        await task  # an aborted stream ends with finish_reason=abort
    finally:
        if not task.done():  # our handler was cancelled
            state.backend.abort(prep.request_id)
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        expired = _expired(state, prep.request_id)
        _release(state, prep.request_id)
    assert final is not None
    reasoning, calls, finish = None, None, final.finish_reason
    if prep.shaper is not None and not final.error:
        shaped = prep.shaper.shape(ids, "".join(text), final.finish_reason)
        text, finish = [shaped.content], shaped.finish_reason
        reasoning, calls = shaped.reasoning, merge_calls(shaped.tool_calls or [])
    if expired:
        return _error(state, 504, "the request's deadline passed; generation stopped", type_="timeout_error")
    if final.error:
        if final.error_status < 500:
            return _error(state, final.error_status, final.error, code=final.error_code)
        type_ = "service_unavailable" if final.error_status == 503 else "server_error"
        return _error(state, final.error_status, final.error, type_=type_)
    return GenerateResponse(
        request_id=prep.request_id,
        text="".join(text),
        reasoning=reasoning,
        tool_calls=calls,
        token_ids=ids,
        finish_reason=finish,
        prompt_tokens=final.prompt_tokens,
        completion_tokens=final.completion_tokens,
        cached_tokens=final.cached_tokens,
        logprobs=logprobs if prep.return_logprobs else None,
        token_logprobs=token_logprobs if prep.return_logprobs else None,
        prompt_logprobs=prompt_logprobs,
    )
