"""The one async interface every generation backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod

from llm_svc.types.request import BackendStats, GenOutput, PreparedRequest, RequestStream  # noqa: F401  (re-exported)


class Backend(ABC):
    """Generation backend: ``submit`` a prepared request, async-iterate its outputs, ``abort``.

    ``submit`` must be called on the event loop that consumes the stream. After ``abort`` the
    stream ends with ``finish_reason="abort"`` and every resource of the request is freed.
    """

    name: str = ""
    # False: the front runs without the weights (they live in another process); ``load_lm`` is
    # then called with ``weights=False``
    needs_weights: bool = True
    # True: ``submit`` takes requests with media by reference and fetches only what its prefix
    # cache misses (through ``media``, set before ``start``); False: the routes fetch every item
    fetches_media: bool = False
    media = None  # llm_svc.core.media_fetch.EmbeddingFetcher
    # True: the backend reports its prefix tree's router keys to ``kv_events`` (a
    # llm_svc.front.kv_publish.KVPublisher, set before ``start`` when the service publishes KV events)
    publishes_kv_events: bool = False
    kv_events = None

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

    def handover_port(self) -> int:
        """Role decode: the port its engine core receives hand-overs on (0: none)."""
        return 0

    def max_sequence_tokens(self) -> int | None:
        """The most tokens (prompt + output) one sequence can ever hold, once started: the KV
        pool's size; None: no bound of the backend's own."""
        return None
