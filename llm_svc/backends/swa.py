"""``swa`` backend: our hybrid SWA engine (dual KV pools, radix prefix cache, continuous
batching), run in its own supervised engine-core process (``llm_svc.core``)."""

from __future__ import annotations

from shared.settings import LLMSettings

from ..core.build import build_engine  # noqa: F401  (the in-process engine, for tests and benchmarks)
from ..core.client import EngineCoreClient
from llm_svc.loading.loader import LoadedLM
from llm_svc.types.request import PreparedRequest
from llm_svc.kv.retention import retention_points
from . import BACKENDS
from .base import Backend, BackendStats, RequestStream


@BACKENDS.register("swa")
class SWABackend(Backend):
    name = "swa"
    needs_weights = False
    fetches_media = True
    publishes_kv_events = True

    def __init__(self, settings: LLMSettings, lm: LoadedLM):
        self.settings = settings
        self.lm = lm
        self.client = EngineCoreClient(settings, lm.tokenizer)

    @property
    def ready(self) -> bool:
        return self.client.ready

    @property
    def detail(self) -> str | None:
        return self.client.detail

    async def start(self) -> None:
        self.client.media = self.media
        self.client.kv_events = self.kv_events
        await self.client.start()

    def submit(self, req: PreparedRequest) -> RequestStream:
        req.swa_checkpoints = retention_points(len(req.prompt_ids), req.system_len,
                                               self.settings.swa_retention_interval, self.settings.swa_retention_max_len)
        if not self.settings.kv_events_url:
            req.router_keys = []  # no KV events published: the core need not track them
        return self.client.submit(req)

    def abort(self, request_id: str) -> None:
        self.client.abort(request_id)

    async def close(self) -> None:
        await self.client.close()

    def handover_port(self) -> int:
        cap = self.client.capacity
        return cap.handover_port if cap is not None else 0

    def max_sequence_tokens(self) -> int | None:
        cap = self.client.capacity
        return cap.num_full_slots if cap is not None else None

    def stats(self) -> BackendStats:
        s = self.client.stats()
        s.engine_restarts = self.client.restarts
        return s
