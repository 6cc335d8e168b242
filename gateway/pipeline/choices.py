"""``n`` > 1: one generation per choice, all on the replica of the first, so the choices after
the first find the prompt in its prefix cache (its scheduler holds an identical prompt until the
first one's prefill is cached: the prompt is computed once, not n times).

Choice ``i`` is request ``{id}-{i}``; with a ``seed``, choice ``i`` samples with ``seed + i`` (a
reproducible, distinct stream per choice). A choice the LLM aborted (it is shutting down or
restarting) fails the request with a 503 (``raise_if_aborted``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from gateway.upstream import LLMClient, LLMStream, UpstreamError
from shared.rawwire import pack_raw, unpack_raw
from shared.schemas import GenerateChunk, GenerateRequest, GenerateResponse

ABORTED = "the LLM service aborted the generation (it is shutting down or restarting); retry the request"


def fan_out(gen: GenerateRequest, packed: bytes, n: int) -> list[tuple[GenerateRequest, bytes]]:
    """The ``n`` choices' requests and bodies (the media tensors repeated in each body)."""
    if n == 1:
        return [(gen, packed)]
    tensors, _ = unpack_raw(packed, GenerateRequest)
    out = []
    for i in range(n):
        s = gen.sampling
        sp = s.model_copy(update={"seed": None if s.seed is None else s.seed + i})
        g = gen.model_copy(update={"request_id": f"{gen.request_id}-{i}", "sampling": sp})
        out.append((g, pack_raw(tensors, g)))
    return out


async def open_all(llms: LLMClient, pairs: list[tuple[GenerateRequest, bytes]]) -> list[LLMStream]:
    """Every choice's stream open, all at once, all to the replica the router picks for the
    first (a non-streamed answer's headers come only when it is done: sending the others after
    the first opened would run the choices one after another)."""
    if len(pairs) == 1:
        return [await llms.open_stream(*pairs[0])]
    prefer = llms.route(pairs[0][0])
    opened = await asyncio.gather(*(llms.open_stream(g, b, prefer=prefer) for g, b in pairs), return_exceptions=True)
    failed = [o for o in opened if isinstance(o, BaseException)]
    if failed:
        for o in opened:
            if not isinstance(o, BaseException):
                await o.aclose()
        raise failed[0]
    return list(opened)


async def generate_all(llms: LLMClient, pairs: list[tuple[GenerateRequest, bytes]]) -> list[GenerateResponse]:
    streams = await open_all(llms, pairs)
    try:
        return list(await asyncio.gather(*(llms.read(s) for s in streams)))
    finally:
        for s in streams:
            await s.aclose()


def raise_if_aborted(resps: list[GenerateResponse]) -> None:
    """503 when the LLM aborted any choice (it is shutting down or restarting)."""
    if any(r.finish_reason == "abort" for r in resps):
        raise UpstreamError(ABORTED, status=503)


class ChoiceStreams:
    """Several choices' streams read as one (``batches()``)."""

    def __init__(self, streams: list[LLMStream]) -> None:
        self.streams = streams

    @property
    def n(self) -> int:
        return len(self.streams)

    async def batches(self) -> AsyncIterator[list[tuple[int, GenerateChunk]]]:
        """``(index, chunk)`` pairs in arrival order, a list of those that arrived together at a time."""
        if len(self.streams) == 1:
            async for b in self.streams[0].batches():
                yield [(0, c) for c in b]
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, s: LLMStream) -> None:
            try:
                async for b in s.batches():
                    for c in b:
                        queue.put_nowait((i, c))
            except BaseException as e:  # a broken stream surfaces in the reader
                queue.put_nowait((i, e))
            finally:
                queue.put_nowait((i, done))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            live = len(tasks)
            while live:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                batch = []
                for i, item in items:
                    if item is done:
                        live -= 1
                    elif isinstance(item, BaseException):
                        if batch:
                            yield batch
                        raise item
                    else:
                        batch.append((i, item))
                if batch:
                    yield batch
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def aclose(self) -> None:
        for s in self.streams:
            await s.aclose()
