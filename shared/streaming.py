"""A streaming response that always runs its cleanup, and a waiter for a client's disconnect
(alone, or raced against the work a request waits on).

Starlette's ``StreamingResponse`` runs the body generator's ``finally`` only if the generator
started: when the client is gone before the first byte (the ``http.response.start`` send fails,
or the disconnect listener wins the race) the generator is never entered, so cleanup written in
it never runs -- an upstream stream stays open, a router's in-flight count leaks, generation runs
on.  ``ClosingStreamingResponse`` calls ``on_close`` exactly once however the response ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Literal

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


async def disconnected(request: Request) -> None:
    """Returns once the client has gone: the body is read, so the server's next ASGI message is
    ``http.disconnect`` (a waiter, not a poll: a service holding thousands of requests spends
    nothing on the ones still waiting, as vLLM's ``listen_for_disconnect``)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def race_disconnect(request: Request, task: asyncio.Future,
                          timeout: float | None = None) -> Literal["done", "gone", "timeout"]:
    """Wait until ``task`` is done ("done"), the client has gone ("gone") or ``timeout`` s pass
    ("timeout"), whichever comes first; ``task`` is left as it is (the caller cancels or aborts
    it), the disconnect waiter is cleaned up either way."""
    gone = asyncio.ensure_future(disconnected(request))
    try:
        done, _ = await asyncio.wait({task, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        return "done" if task in done else "gone" if gone in done else "timeout"
    finally:
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)


class ClosingStreamingResponse(StreamingResponse):
    """``StreamingResponse`` plus ``on_close()``, awaited (shielded from cancellation) after the
    response ends, fails, or never starts; it must be idempotent with the generator's own
    cleanup, which may have run already."""

    def __init__(self, content, *, on_close: Callable[[], Awaitable[None]], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()  # a started generator runs its finally here
                await self._on_close()
