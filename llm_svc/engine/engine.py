"""The engine loop, in one background thread: schedule -> run -> sample -> postprocess -> emit.

Requests enter with ``submit`` (validated and queued in the scheduler at once, so a request
that can never fit fails synchronously); aborts are queued and applied between steps. Outputs
(detokenized, stop strings applied) go to each request's ``RequestStream``.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

import torch

from llm_svc.backends.base import GenOutput, RequestStream
from llm_svc.engine.model_runner import ModelRunner
from llm_svc.engine.request import Request, make_prompt_keys
from llm_svc.engine.sampler import make_generator, sample
from llm_svc.engine.scheduler import Scheduler, StepOutput
from llm_svc.errors import InvalidRequest
from llm_svc.prompt import PreparedRequest
from llm_svc.textproc import OutputText

log = logging.getLogger(__name__)


@dataclass
class _Live:
    prep: PreparedRequest
    stream: RequestStream
    text: OutputText
    generator: torch.Generator | None
    num_out: int = 0
    logprob: float | None = None  # of the token sampled this step (return_logprobs only)


class Engine:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, tokenizer, eos_token_ids: list[int]):
        self.runner = runner
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self._live: dict[str, _Live] = {}
        self._aborts: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # a request is in the scheduler iff it is in _live
        self._stop = False
        self._thread: threading.Thread | None = None
        self.steps = 0
        self._batch_ids: list[str] | None = None  # requests of the step in flight

    # ------------------------------------------------------------------ API (any thread)
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="swa-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(30)
            self._thread = None

    def submit(self, prep: PreparedRequest, stream: RequestStream) -> None:
        """Queue a request; raises ``InvalidRequest`` if it can never run (e.g. too big for the pool)."""
        req = Request(
            req_id=prep.request_id,
            prompt_ids=prep.prompt_ids,
            sampling=prep.sampling,
            prompt_keys=make_prompt_keys(prep.prompt_ids, prep.mm_spans, prep.mm_hashes),
            mm_items=prep.mm_items,
            mm_spans=prep.mm_spans,
            bidirectional=prep.bidirectional,
            eos_token_ids=self.eos_token_ids,
        )
        live = _Live(prep, stream, OutputText(self.tokenizer, prep.sampling), make_generator(prep.sampling))
        with self._lock:
            self._live[req.req_id] = live  # first: the engine may schedule it right after add
            try:
                self.scheduler.add(req)
            except ValueError as e:
                self._live.pop(req.req_id, None)
                raise InvalidRequest(str(e), param="max_tokens") from e
        self._wake.set()

    def abort(self, req_id: str) -> None:
        self._aborts.put(req_id)
        self._wake.set()

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        while not self._stop:
            self._apply_aborts()
            if not self.scheduler.has_unfinished():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            self._batch_ids = None
            try:
                self.step()
            except Exception as e:  # a failed step fails the requests in it, never the engine
                log.exception("engine step failed")
                self._fail(self._batch_ids or list(self._live), f"engine step failed: {e}")

    def step(self) -> list[StepOutput]:
        """One engine step (public for tests that drive the engine without the thread)."""
        batch = self.scheduler.schedule()
        if batch is None:
            self._wake.wait(0.01)
            self._wake.clear()
            return []
        self._batch_ids = [sf.req_id for sf in batch.seqs]
        logits = self.runner.run(batch)
        ids = list(logits)
        tokens: dict[str, int] = {}
        if ids:
            lives = [self._live[i] for i in ids]
            rows = torch.stack([logits[i] for i in ids])  # [N, vocab]
            sampled = sample(rows, [lv.prep.sampling for lv in lives], [lv.generator for lv in lives])
            tokens = dict(zip(ids, sampled))
            for n, (lv, tok) in enumerate(zip(lives, sampled)):
                if lv.prep.return_logprobs:
                    lv.logprob = float(torch.log_softmax(rows[n], -1)[tok])
        outs = self.scheduler.postprocess(batch, tokens)
        for o in outs:
            self._emit(o)
        self._close_orphans()
        self.steps += 1
        return outs

    def _close_orphans(self) -> None:
        """Requests the scheduler dropped on its own (one that cannot fit even alone)."""
        with self._lock:
            gone = [rid for rid in self._live if rid not in self.scheduler.requests]
        for rid in gone:
            self._close(rid, GenOutput(), "abort", 0)

    def _emit(self, o: StepOutput) -> None:
        live = self._live.get(o.req_id)
        if live is None:
            return
        live.num_out += 1
        delta = live.text.push(o.token_id) if o.token_id is not None else ""
        reason = o.finish_reason if o.finished else None
        if live.text.stopped:  # a stop string matched (it wins over length on the same token)
            if reason is None:
                self.scheduler.finish(o.req_id, "stop")
            reason = "stop"
        out = GenOutput(text=delta, token_ids=[o.token_id] if o.token_id is not None else [])
        if live.prep.return_logprobs and o.token_id is not None:
            out.logprobs = [live.logprob]
        if reason is not None:
            out.text += live.text.flush()
            self._close(o.req_id, out, reason, o.num_cached_tokens)
        else:
            live.stream.put(out)

    def _close(self, req_id: str, out: GenOutput, reason: str, cached: int) -> None:
        live = self._live.pop(req_id)
        out.finish_reason = reason
        out.prompt_tokens = len(live.prep.prompt_ids)
        out.completion_tokens = live.num_out
        out.cached_tokens = cached
        live.stream.put(out)

    def _apply_aborts(self) -> None:
        while True:
            try:
                rid = self._aborts.get_nowait()
            except queue.Empty:
                return
            req = self.scheduler.requests.get(rid)
            cached = req.num_cached_tokens if req is not None else 0
            self.scheduler.abort(rid)
            if rid in self._live:
                self._close(rid, GenOutput(), "abort", cached)

    def _fail(self, req_ids: list[str], message: str) -> None:
        for rid in req_ids:
            self.scheduler.abort(rid)
            live = self._live.pop(rid, None)
            if live is not None:
                live.stream.put(GenOutput(error=message, prompt_tokens=len(live.prep.prompt_ids)))
