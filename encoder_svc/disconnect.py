"""Stop serving a request whose client has gone.

Starlette does not cancel a handler when its client disconnects: an encode would run to the end
for nobody. ``unless_disconnected`` runs the work beside a watcher of the ASGI ``receive``
channel (after the body, the next message is ``http.disconnect``) and cancels the work when the
client leaves first.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

from starlette.requests import Request

from encoder_svc.errors import ClientGone

T = TypeVar("T")


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``await work``, or cancel it and raise ``ClientGone`` once the client disconnects. Call
    after the body was read (the watcher consumes ``receive``)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():  # the client left (or this handler was cancelled): the work goes too
            task.cancel()
        watcher.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientGone("the client disconnected before its encode finished")
    return task.result()
