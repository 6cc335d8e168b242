"""One admitted generation answered: as JSON (a body made once every choice is done) or as SSE
(``gateway.pipeline.stream``), under the admission ticket, cancelled if the client leaves and
bounded by the request timeout (carried to the encoders and the LLM as a deadline)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from gateway.edge.limits import TICKET_SCOPE_KEY
from gateway.errors import APIError
from gateway.openai_api.answer_format import ChunkWriter, CompletionChunkWriter
from gateway.pipeline.choices import ChoiceStreams
from gateway.pipeline.stream import sse_events
from gateway.state import GatewayState
from gateway.upstream import UpstreamError, upstream_deadline
from shared.admission import Overloaded, Ticket
from shared.streaming import ClosingStreamingResponse, race_disconnect

log = logging.getLogger("mmserve.gateway.chat")
T = TypeVar("T")

CLIENT_CLOSED = 499  # nginx's "client closed request"


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
