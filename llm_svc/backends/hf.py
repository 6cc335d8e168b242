"""``hf`` backend: the transformers reference, one request at a time in a worker thread.

It is the oracle the ``swa`` engine is checked against, so it stays as plain as possible:
``model.generate(input_ids=...)`` where a one-shot hook on the input embedding module puts the
media rows in place during the prefill (``Gemma3ForConditionalGeneration.generate`` refuses
``inputs_embeds``; this is what its own pixel path does with ``masked_scatter``). Streaming, stop
strings and aborts hook in through a ``StoppingCriteria`` that sees every new token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from shared.settings import LLMSettings

from llm_svc.types.errors import InvalidRequest
from llm_svc.loading.loader import LoadedLM
from llm_svc.types.request import PreparedRequest
from ..engine.logits_procs import TokenHistory, apply_bias_and_penalties, penalised, top_logprobs
from llm_svc.engine.textproc import OutputText, logprob_entry, min_tokens_banned, token_finish_reason
from . import BACKENDS
from .base import Backend, BackendStats, GenOutput, RequestStream

log = logging.getLogger(__name__)


def generation_config(lm: LoadedLM, prep: PreparedRequest) -> GenerationConfig:
    """Sampling knobs for ``generate``; every stop decision is ours (no eos inside generate)."""
    s = prep.sampling
    greedy = s.temperature == 0.0
    return GenerationConfig(
        max_new_tokens=s.max_tokens,
        do_sample=not greedy,
        temperature=None if greedy else s.temperature,
        top_k=None if greedy or s.top_k <= 0 else s.top_k,
        top_p=None if greedy or s.top_p >= 1.0 else s.top_p,
        min_p=None if greedy or s.min_p <= 0.0 else s.min_p,
        eos_token_id=[],  # not None: None falls back to the model's eos and generate would stop there
        pad_token_id=lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0,
    )


def generate_kwargs(lm: LoadedLM, prep: PreparedRequest) -> dict:
    """``input_ids`` (+ Gemma's ``token_type_ids`` so image tokens attend bidirectionally)."""
    ids = torch.tensor([prep.prompt_ids], dtype=torch.long, device=lm.device)  # [1, T]
    kw = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if lm.bidirectional_media:
        tt = torch.zeros_like(ids)
        for start, length, _ in prep.mm_spans:
            tt[0, start : start + length] = 1
        kw["token_type_ids"] = tt
    return kw


@contextlib.contextmanager
def media_rows_injected(lm: LoadedLM, prep: PreparedRequest):
    """While active, the first call of the input embedding module (the prefill) returns the
    prompt's embeddings with the media rows in place; later calls (decode steps) are untouched."""
    emb = input_embeds(lm, prep)[None]  # [1, T, H]
    state = {"done": not prep.mm_spans}

    def hook(module, args, output):
        if state["done"]:
            return None
        assert output.shape == emb.shape, (output.shape, emb.shape)
        state["done"] = True
        return emb.to(output.dtype)

    handle = lm.model.get_input_embeddings().register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


class _Tap(StoppingCriteria):
    """Sees each new token: streams it, applies our stop rules, honours aborts."""

    def __init__(self, lm: LoadedLM, prep: PreparedRequest, stream: RequestStream, aborted: threading.Event):
        self.lm, self.prep, self.stream, self.aborted = lm, prep, stream, aborted
        self.text = OutputText(lm.tokenizer, prep.sampling)
        self.n = 0
        self.finished = False
        self.raw_logits: list[torch.Tensor] = []  # filled by _RawLogits when logprobs are wanted

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        tok = int(input_ids[0, -1])
        self.n += 1
        delta = self.text.push(tok)
        reason = token_finish_reason(tok, self.n, self.prep.sampling, self.lm.eos_token_ids)
        if self.text.stopped:
            reason = "stop"
        if reason is None and self.aborted.is_set():
            reason = "abort"
        out = GenOutput(text=delta, token_ids=[tok])
        if self.prep.return_logprobs:
            (lp, top), = top_logprobs(self.raw_logits[-1], [tok], [self.prep.top_logprobs])
            out.logprobs = [lp]
            out.token_logprobs = [logprob_entry(self.lm.tokenizer, tok, lp, top)]
        if reason is not None:
            out.text += "" if reason == "abort" else self.text.flush()
            self.finish(out, reason)
        else:
            self.stream.put(out)
        return torch.tensor([reason is not None], device=input_ids.device)

    def finish(self, out: GenOutput, reason: str) -> None:
        self.finished = True
        out.finish_reason = reason
        out.prompt_tokens = len(self.prep.prompt_ids)
        out.completion_tokens = self.n
        self.stream.put(out)


class _MinTokens:
    """A logits processor masking EOS and stop tokens until ``min_tokens`` were produced."""

    def __init__(self, tap: _Tap):
        self.tap = tap

    def __call__(self, input_ids, scores):
        banned = min_tokens_banned(self.tap.prep.sampling, self.tap.n, self.tap.lm.eos_token_ids)
        if banned:
            scores = scores.clone()
            scores[:, banned] = float("-inf")
        return scores


class _Knobs:
    """A logits processor adding ``logit_bias`` and the penalties, as the engine does
    (``logits_procs``; the history rebuilt from ``input_ids`` each step: a reference path)."""

    def __init__(self, tap: _Tap):
        self.tap = tap

    def __call__(self, input_ids, scores):
        prep = self.tap.prep
        n = len(prep.prompt_ids)
        hist = None
        if penalised(prep.sampling):
            hist = TokenHistory.start(prep.prompt_ids, input_ids[0, n:].tolist(), scores.shape[-1], scores.device)
        return apply_bias_and_penalties(scores, [prep.sampling], [hist])


class _RawLogits:
    """A logits processor that only records the model's raw next-token logits."""

    def __init__(self, tap: _Tap):
        self.tap = tap

    def __call__(self, input_ids, scores):
        self.tap.raw_logits[:] = [scores.detach()]
        return scores


@BACKENDS.register("hf")
class HFBackend(Backend):
    """Serial reference backend; ``max_running`` is 1 by construction."""

    name = "hf"

    def __init__(self, settings: LLMSettings, lm: LoadedLM):
        if not hasattr(lm.model, "generate"):
            raise ValueError(f"{lm.spec.lm_dir}: this checkpoint format is served by mmserve's own modules, which "
                             "the hf (transformers) backend cannot drive; serve it with --backend swa")
        self.settings = settings
        self.lm = lm
        self._q: queue.Queue = queue.Queue()
        self._aborted: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self._running = 0
        self._thread: threading.Thread | None = None

    async def start(self) -> None:
        self._thread = threading.Thread(target=self._worker, name="hf-backend", daemon=True)
        self._thread.start()

    def submit(self, req: PreparedRequest) -> RequestStream:
        s = req.sampling
        if s.temperature > 0.0 and (s.logit_bias or penalised(s)):
            # transformers runs a custom processor after its temperature / top-k / top-p warpers:
            # the knobs would not mean what they mean in the engine (and in vLLM)
            raise InvalidRequest("the hf backend applies logit_bias and penalties to greedy requests only "
                                 "(temperature 0); use the swa backend to sample with them", param="logit_bias"
                                 if s.logit_bias else "presence_penalty")
        if s.structured is not None:
            tools = s.structured.kind == "structural_tag"  # strict tools under tool_choice auto
            what = "strict tools (or drop strict)" if tools else "response_format and structured_outputs"
            raise InvalidRequest("the hf backend has no structured outputs; use the swa backend for " + what,
                                 param="tools" if tools else "response_format")
        if s.prompt_logprobs is not None or s.max_tokens == 0:
            raise InvalidRequest("the hf backend scores no prompts; use the swa backend for prompt_logprobs, echo "
                                 "with logprobs and max_tokens=0", param="prompt_logprobs" if s.max_tokens else "max_tokens")
        stream = RequestStream(req.request_id, asyncio.get_running_loop())
        ev = threading.Event()
        with self._lock:
            self._aborted[req.request_id] = ev
        self._q.put((req, stream, ev))
        return stream

    def abort(self, request_id: str) -> None:
        with self._lock:
            ev = self._aborted.get(request_id)
        if ev is not None:
            ev.set()

    async def close(self) -> None:
        if self._thread is not None:
            self._q.put(None)
            await asyncio.to_thread(self._thread.join, 30)
            self._thread = None

    def stats(self) -> BackendStats:
        return BackendStats(running=self._running, waiting=self._q.qsize())

    def _worker(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            prep, stream, ev = item
            self._running = 1
            try:
                self._run_one(prep, stream, ev)
            except Exception as e:  # one bad request never stops the worker
                log.exception("hf backend: request %s failed", prep.request_id)
                stream.put(GenOutput(error=f"generation failed: {e}", prompt_tokens=len(prep.prompt_ids)))
            finally:
                self._running = 0
                with self._lock:  # the id may be in use again already (the stream ended first)
                    if self._aborted.get(prep.request_id) is ev:
                        del self._aborted[prep.request_id]

    @torch.inference_mode()
    def _run_one(self, prep: PreparedRequest, stream: RequestStream, aborted: threading.Event) -> None:
        tap = _Tap(self.lm, prep, stream, aborted)
        if aborted.is_set():
            tap.finish(GenOutput(), "abort")
            return
        if prep.sampling.seed is not None:
            torch.manual_seed(prep.sampling.seed)
        with media_rows_injected(self.lm, prep):
            self.lm.model.generate(
                **generate_kwargs(self.lm, prep),
                generation_config=generation_config(self.lm, prep),
                stopping_criteria=StoppingCriteriaList([tap]),
                logits_processor=LogitsProcessorList(
                    ([_RawLogits(tap)] if prep.return_logprobs else [])
                    + ([_MinTokens(tap)] if prep.sampling.min_tokens else [])
                    + ([_Knobs(tap)] if prep.sampling.logit_bias or penalised(prep.sampling) else [])
                ),
            )
        if not tap.finished:  # generate stopped on its own (it should not): close the stream
            tap.finish(GenOutput(text=tap.text.flush()), "length")


def input_embeds(lm: LoadedLM, prep: PreparedRequest) -> torch.Tensor:
    """``[T, hidden]`` embeddings of the whole prompt with media rows in place of the pads."""
    ids = torch.tensor(prep.prompt_ids, dtype=torch.long, device=lm.device)
    emb = lm.embed(ids)
    for start, length, item in prep.mm_spans:
        emb[start : start + length] = prep.mm_items[item]
    return emb
