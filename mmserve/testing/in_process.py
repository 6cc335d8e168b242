"""``InProcessEngine``: an ``Engine`` and an ``OutputProcessor`` in one process, stepped by the
caller: what the core process and the front do together, for tests and benchmarks."""

from __future__ import annotations

from llm_svc.core.convert import request_from_core, to_core_add
from llm_svc.core.output import OutputProcessor
from llm_svc.engine.engine import Engine
from llm_svc.types.request import PreparedRequest


class InProcessEngine:
    """``media(request_id, item_indices) -> {index: tensor}`` answers the engine's needs for
    media sent by reference (what the front's fetcher does), synchronously after each step."""

    def __init__(self, engine: Engine, tokenizer, media=None):
        self.engine = engine
        self.outputs = OutputProcessor(tokenizer)
        self.media = media

    @property
    def scheduler(self):
        return self.engine.scheduler

    @property
    def runner(self):
        return self.engine.runner

    def submit(self, prep: PreparedRequest, sink) -> None:
        """Queue ``prep``; its ``GenOutput``s go to ``sink.put``. Raises ``InvalidRequest``.
        It reaches the engine as the core process's requests do: as a ``CoreAdd``."""
        e = self.engine
        e.add(request_from_core(to_core_add(prep, epoch=0), e.runner.device, None, e.eos_token_ids))
        self.outputs.add(prep, sink)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def has_work(self) -> bool:
        return self.engine.has_work()

    def step(self) -> int:
        """One engine step; returns the number of token outputs it produced."""
        outs = self.engine.step()
        for t in outs:
            if self.outputs.process(t):
                self.engine.abort(t.request_id)
        for need in self.engine.take_needs():
            if self.media is not None:
                self.engine.provide_media(need.request_id, self.media(need.request_id, need.items))
        return len(outs)
