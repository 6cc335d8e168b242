"""The one async interface every generation backend implements."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from ..prompt import PreparedRequest


@dataclass
class GenOutput:
    """An increment of one request's output; the last one has ``finish_reason`` (or ``error``)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    error_status: int = 500  # HTTP status of ``error``: 4xx the request's fault, 5xx ours
    logprobs: list[float] = field(default_factory=list)  # one per token_ids entry, if requested

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class RequestStream:
    """Async iterator over one request's ``GenOutput``s, fed from any thread via ``put``."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self._loop = loop
        self._q: asyncio.Queue[GenOutput] = asyncio.Queue()
        self._done = False

    def put(self, out: GenOutput) -> None:
        """Thread-safe: hand an output to the consumer's event loop."""
        try:
            self._loop.call_soon_threadsafe(self._q.put_nowait, out)
        except RuntimeError:  # loop closed: the consumer is gone
            pass

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> GenOutput:
        if self._done:
            raise StopAsyncIteration
        out = await self._q.get()
        if out.final:
            self._done = True
        return out


@dataclass
class BackendStats:
    running: int = 0
    waiting: int = 0
    kv_full_usage: float = 0.0  # fraction of the full-attention KV pool in use
    kv_swa_usage: float = 0.0
    prefix_hit_tokens: int = 0  # cumulative
    engine_restarts: int = 0  # engine-core processes restarted by the front's supervisor


class Backend(ABC):
    """Generation backend: ``submit`` a prepared request, async-iterate its outputs, ``abort``.

    ``submit`` must be called on the event loop that consumes the stream. After ``abort`` the
    stream ends with ``finish_reason="abort"`` and every resource of the request is freed.
    """

    name: str = ""
    # False: the front runs without the weights (they live in another process); ``load_lm`` is
    # then called with ``weights=False``
    needs_weights: bool = True

    @property
    def ready(self) -> bool:
        """Serving now (an out-of-process engine may be restarting)."""
        return True

    @property
    def detail(self) -> str | None:
        """Why it is not ready, when it is not."""
        return None

    @abstractmethod
    async def start(self) -> None:
        """Start worker threads; the model is already loaded."""

    @abstractmethod
    def submit(self, req: PreparedRequest) -> RequestStream: ...

    @abstractmethod
    def abort(self, request_id: str) -> None: ...

    @abstractmethod
    async def close(self) -> None: ...

    def stats(self) -> BackendStats:
        return BackendStats()
