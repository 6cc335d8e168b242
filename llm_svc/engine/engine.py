"""One engine step, three calls: ``_schedule`` (aborts, admissions, the scheduler's batch, the
KV tiers' moves) -> ``_run`` (the runner's forward) -> ``_postprocess`` (the stages of
``llm_svc.engine.stages`` over the logits, sampling, the scheduler's postprocess, outputs,
drafts for the next step). Token ids out; no threads, no text. What the engine holds per request
is one record (``llm_svc.engine.live.Live``), released in one place (``_release``).

The engine-core process (``llm_svc.core.process``) calls ``add`` / ``abort`` between steps and
``step`` in a loop; detokenization and stop strings live in the front (``llm_svc.core.output``).

Failure containment: every phase of a step (aborts, schedule, run, sample, postprocess, orphan
closing) runs inside one ``try``. When a phase raises, only the requests that phase touched
fail (an abort's target; the step's batch for run, sample and postprocess; the orphans), and
every live request when that is unknown (a failed ``schedule`` may have admitted or preempted
any of them), then ``check_integrity`` proves the bookkeeping is still sound; if it is not,
``EngineBroken`` propagates and the core process exits so that its supervisor restarts it. The
engine is never left silently dead.

Media by reference: a request whose admission needs embeddings it has by key only waits (like
an L3 prefetch, with a deadline) while the front fetches them: ``take_needs`` hands the
front what to fetch, ``provide_media`` brings them in; past ``media_timeout`` it fails (504).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from llm_svc.types.messages import CoreNeed, CoreToken
from llm_svc.engine.model_runner import ModelRunner
from llm_svc.engine.grammar import GrammarCache, GrammarError
from llm_svc.engine.grammar_errors import CompilerUnavailable
from llm_svc.engine.live import Compiling, Live, Prefetch
from llm_svc.engine.sampler import make_generator, sample, skip_draw, suppress
from llm_svc.engine.scheduler import Scheduler
from llm_svc.engine.stages import Draft, GrammarMask, Logprobs, Penalties, Verify
from llm_svc.engine.stages.grammar_mask import BROKEN, STUCK
from llm_svc.types.errors import InvalidRequest
from llm_svc.engine.textproc import min_tokens_banned
from llm_svc.types.request import ForwardBatch, Request, StepOutput

if TYPE_CHECKING:
    from llm_svc.engine.speculate import Speculator

log = logging.getLogger(__name__)


class EngineBroken(RuntimeError):
    """The engine's state is inconsistent after a failure: the process must restart."""


class Engine:
    """``tiers`` (``llm_svc.offload.tiers.KVTiers``): host and L3 KV tiers, or None for the
    device pools alone. ``grammars``: the structured-output compiler, or None (such requests are
    then refused). ``speculator``: drafts and their verification (speculative decoding), or None."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, eos_token_ids: list[int], tiers=None,
                 media_timeout: float = 30.0, grammars: GrammarCache | None = None,
                 speculator: Speculator | None = None):
        self.runner = runner
        self.scheduler = scheduler
        self.speculator = speculator
        self.tiers = tiers
        self.grammars = grammars
        self._compiling: dict[str, Compiling] = {}
        self.media_timeout = media_timeout
        self._prefetching: dict[str, Prefetch] = {}
        self._media_wait: dict[str, float] = {}  # request -> deadline of the media it asked for
        self._needs: list[CoreNeed] = []
        self.eos_token_ids = list(eos_token_ids)
        self._live: dict[str, Live] = {}
        self.penalties = Penalties()
        self.grammar_mask = GrammarMask()
        self.logprobs = Logprobs(self._live)
        self.verify = Verify(speculator)
        self.draft = Draft(speculator, runner, self._live)
        self._stages = (self.penalties, self.grammar_mask, self.logprobs, self.draft)  # those with per-request state
        self._aborts: list[str] = []
        self._affected: list[str] | None = None  # requests of the phase running now
        self._out: list[CoreToken] = []
        self.steps = 0
        self.failures = 0

    # ------------------------------------------------------------------ requests in and out
    def add(self, req: Request) -> None:
        """Queue ``req`` (built from the core's message by ``llm_svc.core.convert.request_from_core``;
        its id unique among live requests, which the front ensures). Raises ``InvalidRequest`` if it
        can never run: too big for the KV pools, structured with no grammar compiler, or with a
        spec over the compiler's size limit."""
        try:
            self.scheduler.check_fits(req)
        except ValueError as e:
            raise InvalidRequest(str(e), param="max_tokens", code="context_length_exceeded") from e
        sp = req.sampling
        gen = make_generator(sp, self.runner.device)
        if sp.structured is not None:
            if self.grammars is None:
                raise InvalidRequest("structured outputs are not served by this engine", param="response_format")
            # queued once its grammar is compiled (see _admit_compiled): never on the step's path
            self._compiling[req.req_id] = Compiling(req, self.grammars.submit(sp.structured))
        else:
            self._queue(req)
        lv = self._live[req.req_id] = Live(req, gen)
        self.logprobs.start(lv)

    def _queue(self, req: Request) -> None:
        # a request scoring its prompt takes no cached prefix: nothing to fetch for it
        fetch = self.tiers is not None and req.sampling.prompt_logprobs is None
        fut = self.tiers.prefetch(req.all_keys[:-1]) if fetch else None
        if fut is not None:  # queued once its L3 lookup is back (see _admit_prefetched)
            self._prefetching[req.req_id] = Prefetch(req, fut, time.monotonic() + self.tiers.prefetch_timeout)
        else:
            self.scheduler.add(req)

    def abort(self, req_id: str) -> None:
        """Stop a request at the start of the next step; it ends with ``finish_reason="abort"``."""
        self._aborts.append(req_id)

    def has_work(self) -> bool:
        return (bool(self._aborts) or bool(self._prefetching) or bool(self._compiling)
                or self.scheduler.has_unfinished())

    def stalled(self) -> bool:
        """Nothing can step until media arrives (the core may block on its inputs meanwhile)."""
        s = self.scheduler
        return (bool(self._media_wait) and not self._aborts and not self._prefetching and not self._compiling
                and not s.running
                and all(r.awaiting_media for r in s.waiting))

    def take_needs(self) -> list[CoreNeed]:
        """Media the front must fetch (asked since the last call)."""
        out, self._needs = self._needs, []
        return out

    def provide_media(self, req_id: str, items: dict[int, torch.Tensor]) -> None:
        """Embeddings a ``CoreNeed`` asked for; ignored for a request that is gone. Raises
        ``InvalidRequest`` when an item does not fit its span (the request then fails)."""
        req = self.scheduler.requests.get(req_id)
        if req is None or req_id not in self._media_wait:
            return
        spans = {idx: n for _, n, idx in req.mm_spans}
        for idx, t in items.items():
            if idx not in spans or t.ndim != 2 or t.shape[0] != spans[idx]:
                self.abort(req_id)
                raise InvalidRequest(f"media item {idx}: embeddings of shape {list(t.shape)} do not fit its span")
        del self._media_wait[req_id]
        self.scheduler.provide_media(req_id, items)

    @property
    def num_live(self) -> int:
        return len(self._live)

    def skip_draw(self, req_id: str) -> None:
        """``req_id``'s own generator (a seeded or sampled request) skips one token's draw: its
        first token was sampled on another engine (a prefill replica), so its next one draws what
        the unified engine's would."""
        lv = self._live.get(req_id)
        if lv is not None and lv.generator is not None:
            skip_draw(lv.generator, self.runner.device)

    def is_live(self, req_id: str) -> bool:
        """``req_id`` was added and has not ended (waiting for anything, queued or running)."""
        return req_id in self._live

    # ------------------------------------------------------------------ one step
    def step(self) -> list[CoreToken]:
        """Schedule, run, postprocess one batch, then close orphans; returns this step's token
        outputs."""
        self._out = []
        try:
            t0 = time.perf_counter()
            batch = self._schedule()
            if batch is not None:
                self._affected = [sf.req_id for sf in batch.seqs]
                self._postprocess(batch, self._run(batch))
                if self.speculator is not None:  # the draft policy's cost model learns from every step
                    d = self.draft
                    self.speculator.observe_step(batch.num_tokens, d.mtp_rows, d.mtp_layers, d.mtp_seconds,
                                                 time.perf_counter() - t0)
            gone = self._orphans()
            self._affected = gone
            self._close_orphans(gone)
            self.steps += 1
        except Exception as e:  # a failed phase fails the requests it touched, never the engine
            self.failures += 1
            victims = self._affected if self._affected is not None else list(self._live)
            log.exception("engine step failed; failing %d request(s)", len(victims))
            self._fail(victims, f"the engine failed while running this request ({type(e).__name__}); "
                                "retry it")
        self._affected = None
        return self._out

    # ------------------------------------------------------------------ schedule
    def _schedule(self) -> ForwardBatch | None:
        """Aborts, admissions, then the scheduler's batch (None: nothing to run), with the KV
        tiers' notes and moves around it."""
        self._apply_aborts()
        self._affected = None
        if self._media_wait:
            self._expire_media()
        if self._compiling:
            self._admit_compiled()
        if self._prefetching:
            self._admit_prefetched()
        tiers = self.tiers
        if not self.scheduler.has_unfinished():
            if tiers is not None:
                tiers.write_notes()
            return None
        if tiers is not None:
            tiers.write_notes()  # before schedule: the noted slots still hold their KV
            tiers.run_ops()
        batch = self.scheduler.schedule()
        self._collect_needs()
        if tiers is not None:
            tiers.run_ops()  # demotions and load-backs before the forward
            tiers.touch_hits()
        return batch

    def _admit_compiled(self) -> None:
        """Queue requests whose grammar is compiled; fail (400) those whose grammar cannot be."""
        ready = [rid for rid, c in self._compiling.items() if c.future.done()]
        if not ready and not self.scheduler.has_unfinished() and not self._prefetching:
            first = next(iter(self._compiling.values()))  # nothing else to do: wait, don't spin
            try:
                first.future.result(timeout=0.005)
            except Exception:
                pass
            return
        for rid in ready:
            c = self._compiling.pop(rid)
            self._affected = [rid]
            err = c.future.exception()
            if isinstance(err, CompilerUnavailable):  # the compiler's fault, not the request's
                self._fail([rid], f"structured outputs are unavailable: {err}", status=503)
                continue
            if err is not None:  # the spec's fault (a timeout included): a 400 that says what to change
                msg = str(err) if isinstance(err, GrammarError) else \
                    f"the grammar could not be compiled ({type(err).__name__}); check it"
                self._fail([rid], msg, status=400, code=getattr(err, "code", None))
                continue
            matcher = self.grammars.matcher(c.future.result())
            # a request continued from a hand-over arrives with its first token, sampled under
            # the same grammar on the prefill replica: the grammar takes it before the next
            if not all(matcher.accept(t) for t in c.req.output_ids):
                self._fail([rid], BROKEN, status=500)
                continue
            self.grammar_mask.start(self._live[rid], matcher)
            self._queue(c.req)
        self._affected = None

    def _admit_prefetched(self) -> None:
        """Queue requests whose L3 lookup is back (its hit goes into the host tier first) or
        late (they go on without it)."""
        now = time.monotonic()
        ready = [rid for rid, p in self._prefetching.items() if p.future.done() or now >= p.deadline]
        if not ready and not self.scheduler.has_unfinished():
            # nothing else to do: wait a moment for the first lookup instead of spinning
            first = next(iter(self._prefetching.values()))
            try:
                first.future.result(timeout=max(0.0, min(0.005, first.deadline - now)))
            except Exception:
                pass
            return
        for rid in ready:
            p = self._prefetching.pop(rid)
            self._affected = [rid]
            if p.future.done() and p.future.exception() is None:
                self.tiers.ingest(p.req.all_keys, p.future.result())
            else:
                self.tiers.stats["l3_wait_seconds"] += self.tiers.prefetch_timeout
            self.scheduler.add(p.req)
        self._affected = None

    def _expire_media(self) -> None:
        now = time.monotonic()
        late = [rid for rid, deadline in self._media_wait.items() if now >= deadline]
        if late:
            self._affected = late
            self._fail(late, f"the request's media did not arrive within {self.media_timeout:g} s; retry it",
                       status=504)
            self._affected = None

    def _collect_needs(self) -> None:
        deadline = time.monotonic() + self.media_timeout
        for rid, items in self.scheduler.take_media_needs():
            self._media_wait[rid] = deadline
            self._needs.append(CoreNeed(rid, items))

    # ------------------------------------------------------------------ run
    def _run(self, batch: ForwardBatch) -> dict[str, torch.Tensor]:
        """The forward: ``req_id -> logits`` (``[vocab]``, or ``[n, vocab]`` for ``all_logits``
        seqs and verifying decodes)."""
        return self.runner.run(batch)

    # ------------------------------------------------------------------ postprocess
    def _postprocess(self, batch: ForwardBatch, logits: dict[str, torch.Tensor]) -> None:
        self.logprobs.score_prompts(batch, logits)
        drafts = {sf.req_id: sf.token_ids[-sf.num_drafts:] for sf in batch.seqs if sf.num_drafts}
        # 0 max_tokens: the prompt alone
        ids = [rid for rid in logits if rid not in drafts and self._live[rid].req.sampling.max_tokens > 0]
        tokens: dict[str, int | list[int]] = {}
        stop_now: set[str] = set()
        logprobs: dict[str, list[tuple[float, list[tuple[int, float]]]]] = {}  # per emitted token, in order
        if ids:
            self._sample(ids, logits, tokens, stop_now, logprobs)
        for rid, dr in drafts.items():
            lv, req = self._live[rid], self.scheduler.requests[rid]
            v = self.verify.run(rid, lv, req, logits[rid], dr)
            if v.error is not None:
                self._fail([rid], v.error[0], status=v.error[1])
                continue
            if v.done:
                stop_now.add(rid)
            tokens[rid] = v.tokens
            lp = self.logprobs.verified(lv, logits[rid], v.tokens)
            if lp is not None:
                logprobs[rid] = lp
        # before the scheduler's postprocess: the window's slots are still held
        mtp_drafts = self.draft.mtp(batch, tokens, self.scheduler.requests)
        for o in self.scheduler.postprocess(batch, tokens, stop=stop_now):
            lv = self._live.get(o.req_id)
            if lv is not None:
                self.penalties.emitted(lv, o.token_id)
            lp = logprobs.get(o.req_id)
            self._emit(o, *(lp.pop(0) if lp else (None, None)))
        self.draft.propose(batch, mtp_drafts, self.scheduler.requests)
        if self.tiers is not None:
            self.tiers.write_notes()

    def _sample(self, ids: list[str], logits: dict[str, torch.Tensor], tokens: dict, stop_now: set[str],
                logprobs: dict) -> None:
        """One token for each of ``ids`` (their last rows): penalties, grammar masks,
        ``min_tokens``' ban, the sampler; then the grammars advance and logprobs are taken."""
        lives = [self._live[i] for i in ids]
        rows = torch.stack([logits[i] for i in ids])  # [N, vocab]: the raw model, for logprobs
        params = [lv.req.sampling for lv in lives]
        banned = {n: min_tokens_banned(lv.req.sampling, len(self.scheduler.requests[rid].output_ids),
                                       self.eos_token_ids)
                  for n, (rid, lv) in enumerate(zip(ids, lives)) if lv.req.sampling.min_tokens}
        for rid, lv in zip(ids, lives):
            self.penalties.start(lv, self.scheduler.requests[rid], rows.shape[1], rows.device)
        x = self.penalties.apply(rows, params, lives)
        constrained = any(lv.matcher is not None for lv in lives)
        stuck: list[str] = []
        if constrained:
            x, stuck = self.grammar_mask.mask(x, rows, ids, lives)
        if any(banned.values()):
            y = suppress(x, banned)
            x = self.grammar_mask.keep_ends(x, y) if constrained else y
        sampled = sample(x, params, [lv.generator for lv in lives])
        tokens.update(zip(ids, sampled))
        if constrained:
            done, broken = self.grammar_mask.advance(ids, lives, sampled, set(stuck))
            stop_now.update(done)
            if stuck:  # the request's fault (a grammar this vocabulary cannot write), not the batch's
                self._fail(stuck, STUCK, status=400)
            if broken:
                self._fail(broken, BROKEN)
        logprobs.update(self.logprobs.sampled(rows, ids, lives, sampled))

    def _emit(self, o: StepOutput, logprob: float | None, top: list[tuple[int, float]] | None) -> None:
        lv = self._live.get(o.req_id)
        if lv is None:
            return
        prompt = self.logprobs.take_prompt(lv, o.req_id)  # the first output: the prefill scored every position
        reason = o.finish_reason if o.finished else None
        self._out.append(CoreToken(o.req_id, o.token_id, logprob, reason, o.num_cached_tokens, top=top or None,
                                   prompt_logprobs=prompt))
        if reason is not None:
            self._release(o.req_id)

    # ------------------------------------------------------------------ requests ending
    def _orphans(self) -> list[str]:
        """Requests the scheduler dropped on its own (one that cannot fit even alone)."""
        return [rid for rid in self._live if rid not in self.scheduler.requests and rid not in self._prefetching
                and rid not in self._compiling]

    def _close_orphans(self, gone: list[str]) -> None:
        for rid in gone:
            self._release(rid)
            self._out.append(CoreToken(rid, finish_reason="abort"))

    def _apply_aborts(self) -> None:
        while self._aborts:
            rid = self._aborts.pop(0)
            self._affected = [rid]
            req = self.scheduler.requests.get(rid)
            cached = req.num_cached_tokens if req is not None else 0
            if self._release(rid) is not None:
                self._out.append(CoreToken(rid, finish_reason="abort", num_cached_tokens=cached))

    def _fail(self, req_ids: list[str], message: str, status: int = 500, code: str | None = None) -> None:
        try:
            for rid in req_ids:
                if self._release(rid) is not None:
                    self._out.append(CoreToken(rid, error=message, status=status, code=code))
            self.scheduler.check_integrity()
        except Exception as e:
            raise EngineBroken(f"engine state inconsistent after a failure: {type(e).__name__}: {e}") from e

    def _release(self, rid: str) -> Live | None:
        """Everything the engine holds for ``rid`` goes, here only: its admission wait (an L3
        lookup, a grammar compile, media), its scheduler state and KV (a no-op when the scheduler
        already finished or dropped it), its record with each stage's state. Returns the record,
        None when ``rid`` was not live."""
        self._prefetching.pop(rid, None)
        c = self._compiling.pop(rid, None)
        if c is not None:  # the compile stops unless another request waits for it too
            c.future.cancel()
        self._media_wait.pop(rid, None)
        self.scheduler.abort(rid)
        lv = self._live.pop(rid, None)
        if lv is not None:
            for stage in self._stages:
                stage.release(lv)
        return lv

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, float]:
        out = {**self.scheduler.stats(), "steps": self.steps, "failures": self.failures,
               "prefetching": len(self._prefetching), "media_waiting": len(self._media_wait),
               "grammar_compiling": len(self._compiling)}
        if self.grammars is not None:
            out.update(self.grammars.stats())
        if self.tiers is not None:
            out.update(self.tiers.metrics())
        if self.speculator is not None:
            for k, v in self.speculator.stats.as_dict().items():  # flat numbers (per position: _j)
                if isinstance(v, list):
                    out.update({f"spec_{k}_{j}": x for j, x in enumerate(v)})
                elif v is not None:
                    out[f"spec_{k}"] = v
            pol = self.speculator.policy
            for (_, k), n in pol.chosen.items():  # steps by the most drafts any request was given
                out[f"spec_steps_k{k}"] = out.get(f"spec_steps_k{k}", 0) + n
            cost = getattr(pol, "cost", None)
            if cost is not None and cost.n:
                out["spec_cost_model_error"] = round(cost.err, 4)  # decayed mean |predicted - measured| / measured
        return out
