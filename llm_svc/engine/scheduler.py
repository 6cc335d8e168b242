"""Continuous batching with chunked prefill over the dual KV pools. Pure bookkeeping.

One engine step: ``schedule()`` -> runner -> ``postprocess(batch, next_tokens)``.

* Decodes first (oldest first), then the next chunks of running prefills (each at most
  ``chunk_tokens``), then admissions, all within ``max_batch_tokens`` tokens per step.
* Admission (policy order) matches the window-safe cached prefix, then needs full slots for the
  whole rest of the sequence and SWA slots for the first chunk, counting what eviction can free
  (plus one slot of each per running request for its next decode).
* SWA slots that leave the window are released after every prefill chunk, every
  ``decode_release_interval`` decode tokens, and at the end: a request holds at most
  ``W + max(chunk, N)`` SWA slots, plus its pinned cached window (until it is ``W`` past it) and
  at most two kept windows for the prefix cache (a branch point, a ``swa_checkpoints`` entry or
  the prompt's end: a follow-up turn re-sends the prompt but rarely the generated token ids).
* When a request's prefill completes, its computed KV goes into the prefix tree at once (it keeps
  a lock and continues from the tree's slots), so concurrent requests sharing it hit it.
* The runner keeps each request's slot tables across steps: a batch carries only the new
  tokens' slots, a table reset when a view was created or rewritten (``SeqKV.synced``), and the
  ids of requests whose views ended (``ForwardBatch.dropped``). A decode is O(1) here.
* When a decode cannot get a slot, the newest running request not already in this step's batch
  is preempted: its computed KV goes into the prefix tree (or is freed without caching) and it
  is requeued first, to recompute prompt + outputs so far.
* Prompt logprobs, and how a request's next chunk and its ``SeqForward`` are cut:
  ``llm_svc.engine.sched_seq``.
* Media by reference: a request's items may be known by key only (``mm_items[i] is None``).
  Admission computes the cached prefix first; when a media span ends past it and its item is
  missing, the request is not admitted: it is marked ``awaiting_media`` (skipped by admission)
  and ``(req_id, item indices)`` goes to ``media_needs`` for the engine to fetch. Spans the
  prefix cache covers are never fetched. ``provide_media`` makes it admissible again (the match
  is re-checked then: it may have shrunk). Only the presence of an item is looked at here.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from llm_svc.types.request import ForwardBatch, Request, RequestStatus, SeqForward, StepOutput
from llm_svc.engine.sched_config import SchedulerConfig
from llm_svc.engine.sched_policy import make_policy
from llm_svc.engine.sched_seq import build_seq, chunk_end, matchable, missing_media
from llm_svc.kv.manager import KVManager
from llm_svc.kv.radix import NO_SLOT
from llm_svc.engine.textproc import token_finish_reason

AWAIT_MEDIA = object()  # ``_admit``'s answer for a request that needs embeddings it lacks


class Scheduler:
    """Owns the request queues and one ``KVManager``. Single-threaded: the engine's step loop
    calls every method (``abort``/``finish`` between steps); ``schedule`` and ``postprocess``
    alternate (the runner runs in between). ``postprocess`` needs a token for every seq with
    ``need_logits``."""

    def __init__(
        self, config: SchedulerConfig, num_full_slots: int, num_swa_slots: int,
        clock: Callable[[], float] = time.monotonic, num_host_full: int = 0, num_host_swa: int = 0,
    ) -> None:
        if config.release_swa and num_swa_slots < config.min_swa_slots():
            raise ValueError(
                f"SWA pool of {num_swa_slots} slots is too small: need >= {config.min_swa_slots()} "
                "(4*window + max(chunk, decode_release_interval) + 1)"
            )
        self.config = config
        self.kv = KVManager(num_full_slots, num_swa_slots, config.window, config.enable_prefix_cache,
                            num_host_full, num_host_swa, config.l3_page_tokens)
        self.policy = make_policy(config.policy)
        # the admission policy's "now" (same time base as Request.arrival_time); a simulation
        # passes its simulated clock
        self.clock = clock
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # admission order: oldest first
        self.requests: dict[str, Request] = {}
        self._dropped: list[str] = []  # views ended since the last batch (the runner frees their tables)
        self._truncated: dict[str, int] = {}  # views cut back since the last batch (rejected drafts)
        self.media_needs: list[tuple[str, list[int]]] = []  # (req_id, item indices) to fetch
        self.num_preemptions = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0

    # ------------------------------------------------------------------ requests in and out
    def check_fits(self, req: Request) -> None:
        """Raise ValueError if ``req`` can never fit in the full pool (prompt + max_tokens slots)."""
        need = len(req.prompt_ids) + req.sampling.max_tokens
        if need > self.kv.full_pool.num_slots:
            raise ValueError(
                f"the request needs {need} KV slots (prompt + max_tokens) but the KV pool holds "
                f"{self.kv.full_pool.num_slots}; shorten the prompt or max_tokens"
            )

    def add(self, req: Request) -> None:
        """Queue a request. Raises ValueError if it can never fit in the full pool. Its id must
        be unique among the scheduler's requests (the front refuses a duplicate)."""
        self.check_fits(req)
        assert req.req_id not in self.requests, f"duplicate request id {req.req_id}"
        req.status = RequestStatus.WAITING
        self.requests[req.req_id] = req
        self.waiting.append(req)

    def abort(self, req_id: str) -> bool:
        """Drop a request and free everything it holds; safe at any time. False if unknown."""
        req = self.requests.get(req_id)
        if req is None:
            return False
        self._finish(req, "abort")
        return True

    def finish(self, req_id: str, reason: str = "stop") -> bool:
        """Finish a request now (the engine matched a stop string). False if unknown."""
        req = self.requests.get(req_id)
        if req is None:
            return False
        self._finish(req, reason)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def take_media_needs(self) -> list[tuple[str, list[int]]]:
        """What admission found missing since the last call (each request asks once per wait)."""
        out, self.media_needs = self.media_needs, []
        return out

    def provide_media(self, req_id: str, items: dict) -> bool:
        """Item index -> embeddings for a request sent by reference; it is admissible again.
        False if the request is gone (aborted, finished)."""
        req = self.requests.get(req_id)
        if req is None:
            return False
        for idx, value in items.items():
            req.mm_items[idx] = value
        req.awaiting_media = False
        return True

    # ------------------------------------------------------------------ one step
    def schedule(self) -> ForwardBatch | None:
        """The next step's batch, or None when there is nothing to run."""
        for _ in range(len(self.running) + 2):
            batch = self._schedule_once()
            if batch.seqs or not self.running:
                if not batch.seqs:
                    return None
                batch.dropped, self._dropped = self._dropped, []
                batch.truncated, self._truncated = self._truncated, {}
                return batch
            # running requests exist but none could get slots: make room and retry
            if len(self.running) == 1:
                self._finish(self.running[0], "abort")  # cannot progress even alone
            else:
                self._preempt(self.running[-1])
        return None

    def _schedule_once(self) -> ForwardBatch:
        cfg = self.config
        budget = cfg.max_batch_tokens
        seqs: list[SeqForward] = []
        in_batch: set[str] = set()
        prefill = 0  # prompt tokens of this step
        preempted_before = self.num_preemptions
        decoding = [r for r in self.running if r.num_tokens - r.num_computed == 1]
        # drafts each decode may verify: all of them when they fit the step's draft budget (the
        # draft policy shares it out), else an even share of it
        asked = sum(len(r.spec_tokens) for r in decoding)
        per_decode = asked if asked <= cfg.max_draft_tokens else max(1, cfg.max_draft_tokens // len(decoding))
        for req in list(self.running):  # decodes, each with its drafts if it has room for them
            if budget < 1:
                break
            if req.status != RequestStatus.RUNNING or req.num_tokens - req.num_computed != 1:
                continue
            drafts, req.spec_tokens = req.spec_tokens[:min(budget - 1, per_decode)], []
            end = req.num_tokens + len(drafts)
            if drafts and not self._reserve_chunk(req, req.num_computed, end):
                drafts, end = [], req.num_tokens  # drafts never preempt anyone: a plain decode
            if not drafts and not self._reserve_decode(req, in_batch):
                continue
            seqs.append(build_seq(self.config.window, req, req.num_computed, end, drafts))
            in_batch.add(req.req_id)
            budget -= end - req.num_computed
        for req in list(self.running):  # prefill chunks
            if budget < 1:
                break
            if req.status != RequestStatus.RUNNING or req.req_id in in_batch:
                continue
            start = req.num_computed
            end = chunk_end(req, start, min(budget, cfg.chunk_tokens, self.kv.available_swa()), cfg.chunk_tokens)
            if end > start and self._reserve_chunk(req, start, end):
                seqs.append(build_seq(self.config.window, req, start, end))
                in_batch.add(req.req_id)
                budget -= end - start
                prefill += end - start
        # no admissions in a step that had to preempt (it would take the freed room right back)
        if budget >= 1 and len(self.running) < cfg.max_running and self.waiting and (
            self.num_preemptions == preempted_before
        ):
            admissible = [r for r in self.waiting if not r.awaiting_media]
            order = self.policy.order(admissible, self.clock(), self.kv.tree.peek_match_len)
            # a prompt identical to one still in prefill (n > 1's choices, a client's retry) waits
            # for that prefill to enter the prefix cache, then computes its last token only
            prefilling = ({r.prompt_sig for r in self.running if not r.prefill_cached}
                          if cfg.enable_prefix_cache else None)
            for req in order:
                if budget < 1 or len(self.running) >= cfg.max_running or 0 < cfg.prefill_step_tokens <= prefill:
                    break
                if prefilling and req.prompt_sig in prefilling and matchable(req, req.num_tokens) > 0:
                    continue  # (one that may take no cached prefix, e.g. scoring its prompt, need not wait)
                sf = self._admit(req, budget, fallback=not self.running and not seqs)
                if sf is AWAIT_MEDIA:
                    continue
                if sf is None:
                    break
                if prefilling is not None:
                    prefilling.add(req.prompt_sig)
                seqs.append(sf)
                in_batch.add(req.req_id)
                budget -= len(sf.token_ids)
                prefill += len(sf.token_ids)
        return ForwardBatch(seqs)

    def _reserve_chunk(self, req: Request, start: int, end: int) -> bool:
        return self.kv.reserve(req.kv, max(end, len(req.kv.full)), start, end)

    def _reserve_decode(self, req: Request, in_batch: set[str]) -> bool:
        """A slot for ``req``'s next token, preempting the newest requests not in this step's
        batch until it fits; False when it cannot (``req`` itself may have been preempted)."""
        while not self._reserve_chunk(req, req.num_computed, req.num_tokens):
            victim = next((r for r in reversed(self.running) if r.req_id not in in_batch), None)
            if victim is None:
                return False
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _admit(self, req: Request, budget: int, fallback: bool):
        """The first chunk of ``req`` (now running), None (no room), or ``AWAIT_MEDIA``."""
        keys = req.all_keys
        total = len(keys)
        forbidden = [(s, s + n) for s, n, _ in req.mm_spans] if req.bidirectional else []
        for attempt in (0, 1) if fallback else (0,):
            seq = (
                self.kv.start(keys[: matchable(req, total)], forbidden, req.swa_checkpoints, len(req.prompt_ids))
                if attempt == 0 else self.kv.start([], prompt_end=len(req.prompt_ids))
            )
            start = seq.cached_len
            missing = missing_media(req, start)
            if missing:
                self.kv.finish(seq, keys, seq.cached_len, cache=False)
                req.awaiting_media = True
                self.media_needs.append((req.req_id, missing))
                return AWAIT_MEDIA
            end = chunk_end(req, start, min(budget, self.config.chunk_tokens), self.config.chunk_tokens)
            # leave one slot per running request for its next decode token
            reserve = len(self.running)
            need_full, need_swa = self.kv.needs(seq, total, start, end)
            ok = (
                end > start
                and need_full + reserve <= self.kv.available_full()
                and need_swa + reserve <= self.kv.available_swa()
                and self.kv.reserve(seq, total, start, end)
            )
            if ok:
                break
            self.kv.finish(seq, keys, seq.cached_len, cache=False)
        else:
            return None
        self.waiting.remove(req)
        req.kv = seq
        req.num_computed = seq.cached_len
        req.decodes_since_release = 0
        req.prefill_cached = False
        req.status = RequestStatus.RUNNING
        if not req.admitted_once:
            req.admitted_once = True
            req.num_cached_tokens = min(seq.cached_len, len(req.prompt_ids))
            if self.config.l3_page_tokens and seq.cached_len:
                self.kv.hits.append(keys[:seq.cached_len])
            self.prompt_tokens += len(req.prompt_ids)
            self.cached_tokens += req.num_cached_tokens
        self.running.append(req)
        return build_seq(self.config.window, req, start, end)

    def postprocess(self, batch: ForwardBatch, next_tokens: dict[str, int | list[int]],
                    stop: set[str] | frozenset[str] = frozenset()) -> list[StepOutput]:
        """Mark the batch's KV written, append sampled tokens (``next_tokens[req_id]`` for every
        seq with ``need_logits``, but a request with ``max_tokens == 0``: it finishes with its
        prefill, "length", without a token), finish requests (and those in ``stop`` with "stop", e.g. a
        completed grammar), and release out-of-window SWA slots.

        A seq that verified d drafts gets a list: the a accepted drafts and one more token. Its KV
        stays written for the input token and the accepted drafts only; the slots of the rejected
        positions go back to the pools (the runner's tables are cut in the next batch). Tokens
        after one that finishes the request are dropped."""
        outs: list[StepOutput] = []
        for sf in batch.seqs:
            req = self.requests.get(sf.req_id)
            if req is None or req.status != RequestStatus.RUNNING or sf.start != req.num_computed:
                continue  # aborted or finished while the step ran (or an id reused since)
            toks = next_tokens.get(sf.req_id) if sf.need_logits else None
            toks = [] if toks is None else [int(t) for t in toks] if isinstance(toks, list) else [int(toks)]
            assert len(toks) <= sf.num_drafts + 1, f"{sf.req_id}: {len(toks)} tokens for {sf.num_drafts} drafts"
            end = sf.start + len(toks) if sf.num_drafts else sf.end  # KV that holds kept tokens
            req.num_computed = end
            if sf.all_logits:
                req.prompt_scored = max(req.prompt_scored, min(end, len(req.prompt_ids) - 1))
            if self.config.l3_page_tokens and not req.prefill_cached:
                if sf.need_logits or any(sf.start < c <= end for c in req.swa_checkpoints):
                    # before the release below: the windows at this chunk's boundaries
                    self.kv.note_l3(req.kv, req.all_keys, end, req.swa_checkpoints)
            if sf.need_logits and not req.prefill_cached:
                # prefill done: cache it now, so concurrent requests sharing it hit it.
                # Out-of-window SWA is released first, but W + 1 positions stay: a request
                # re-sending the same prompt matches all but its last token (needs the
                # window ending at end - 1), a follow-up turn matches up to end
                req.prefill_cached = True
                if self.config.release_swa:
                    self.kv.release_window(req.kv, end - self.config.window - 1)
                self.kv.cache_prefix(req.kv, req.all_keys, end)
            if sf.need_logits and req.sampling.max_tokens == 0:  # the prompt alone (echo)
                self._finish(req, "length")
                outs.append(StepOutput(req.req_id, None, True, "length", req.num_cached_tokens))
                continue
            if sf.need_logits:
                if self._take_tokens(req, toks, sf.req_id in stop, outs):
                    continue  # finished
                if sf.num_drafts and len(req.kv.full) > req.num_computed:
                    self.kv.truncate(req.kv, req.num_computed)  # the rejected drafts' slots
                    self._truncated[req.req_id] = req.num_computed
            if len(sf.token_ids) == 1 or sf.num_drafts:
                req.decodes_since_release += len(toks)
                if req.decodes_since_release < self.config.decode_release_interval:
                    continue
            self._release_window(req)
        return outs

    def _take_tokens(self, req: Request, toks: list[int], stop: bool, outs: list[StepOutput]) -> bool:
        """Append ``toks`` one by one until one finishes ``req`` (``stop``: the last one does);
        True when it finished. Its computed KV then covers its tokens but the last."""
        for n, tok in enumerate(toks):
            req.output_ids.append(tok)
            reason = self._stop_reason(req, tok) or ("stop" if stop and n == len(toks) - 1 else None)
            if reason is not None:
                req.num_computed = min(req.num_computed, req.num_tokens - 1)
                self._finish(req, reason)
                outs.append(StepOutput(req.req_id, tok, True, reason, req.num_cached_tokens))
                return True
            outs.append(StepOutput(req.req_id, tok, False, None, req.num_cached_tokens))
        return False

    @staticmethod
    def _stop_reason(req: Request, tok: int) -> str | None:
        return token_finish_reason(tok, len(req.output_ids), req.sampling, req.eos_token_ids)

    # ------------------------------------------------------------------ freeing
    def _release_window(self, req: Request) -> None:
        req.decodes_since_release = 0
        if self.config.release_swa:
            self.kv.release_window(req.kv, req.num_computed - self.config.window)

    def _note_leaving(self, req: Request) -> None:
        """Before a running request's KV goes: the generated part for the lower tier."""
        if self.config.l3_page_tokens and req.num_computed > len(req.prompt_ids):
            self.kv.note_l3(req.kv, req.all_keys, req.num_computed)

    def _release_kv(self, req: Request) -> None:
        """A running request leaves ``running``: its generated KV noted for the lower tier, its
        out-of-window SWA released, its computed KV into the prefix tree (or freed), the runner's
        view of it dropped."""
        self._note_leaving(req)
        self._release_window(req)
        self.kv.finish(req.kv, req.all_keys, req.num_computed, cache=True)
        self.running.remove(req)
        self._dropped.append(req.req_id)
        req.kv = None

    def _preempt(self, req: Request) -> None:
        self._release_kv(req)
        req.spec_tokens = []
        req.num_computed = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.insert(0, req)
        self.num_preemptions += 1

    def _finish(self, req: Request, reason: str) -> None:
        req.spec_tokens = []
        if req.status == RequestStatus.RUNNING:
            self._release_kv(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.req_id, None)

    # ------------------------------------------------------------------ checks & stats
    def check_integrity(self) -> None:
        """Pools partition exactly (free + cached + in use), every running request holds SWA KV
        for its whole current window, and queue states agree."""
        w = self.config.window
        for req in self.running:
            assert req.status == RequestStatus.RUNNING and req.kv is not None
            assert self.requests.get(req.req_id) is req
            kv = req.kv
            assert kv.cached_len <= req.num_computed <= len(kv.full) <= req.num_tokens
            lo = max(0, req.num_computed - w)
            assert NO_SLOT not in kv.swa[lo:req.num_computed], f"{req.req_id}: window lost"
            assert not missing_media(req, req.num_computed), f"{req.req_id}: runs without its media"
        for req in self.waiting:
            assert req.status == RequestStatus.WAITING and req.kv is None
            assert self.requests.get(req.req_id) is req
            assert not req.awaiting_media or None in req.mm_items, f"{req.req_id} awaits no media"
        assert len(self.requests) == len(self.running) + len(self.waiting)
        self.kv.check_integrity([r.kv for r in self.running])

    def stats(self) -> dict[str, float]:
        u = self.kv.usage()
        return {
            **u,
            "running": len(self.running),
            "waiting": len(self.waiting),
            "preemptions": self.num_preemptions,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
        }
