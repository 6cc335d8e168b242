"""The decode side of an engine: requests continue from a ``Handover``.

``DecodeSide.add(req, handover)`` checks the hand-over (``check``: the same request and prompt,
the same KV fingerprint, every page present, in order, of its declared length and digest), takes
slots for its KV (``KVManager.adopt``), runs the tier copies that eviction recorded, writes the
pages into the pools and gives the slots to the prefix tree. The request then joins the engine
with the first token as its first output: its admission matches the whole prompt in the tree and
its first step is the decode of that token, as in the unified engine.

The adopted prefix stays locked in the tree until the request is admitted (its own match then
holds it) or gone, so the KV is not evicted while the request waits: ``step`` releases those
locks after each engine step.

Anything that does not check out (or no room for the KV) and the request is queued the same way
without the KV: it recomputes prompt + first token, as after a preemption, and never decodes from
KV it could not prove. Each such fallback is counted by its reason.
"""

from __future__ import annotations

from collections import Counter

from llm_svc.attention import FULL, SLIDING
from llm_svc.disagg.messages import FULL_PAGE, WINDOW_PAGE, Handover
from llm_svc.engine.engine import Engine
from llm_svc.kv.radix import LockHandle
from llm_svc.offload import kv_pack
from llm_svc.types.messages import CoreToken
from llm_svc.types.request import Request


def check(h: Handover, req: Request, fingerprint: str, window: int, full_token_bytes: int,
          swa_token_bytes: int) -> str | None:
    """Why ``h``'s KV cannot be used for ``req`` here (a short reason), or None when it can."""
    n = len(h.prompt_ids)
    if h.request_id != req.req_id or h.prompt_ids != req.prompt_ids or h.prompt_keys != req.prompt_keys:
        return "mismatch"
    if h.fingerprint != fingerprint or h.window != window or h.page_tokens < 1:
        return "fingerprint"
    if not h.pages:
        return "no_kv"
    *full, win = h.pages
    pos = 0
    for pg in full:
        if pg.kind != FULL_PAGE or pg.start != pos or not 0 < pg.tokens <= h.page_tokens:
            return "layout"
        if pg.nbytes != pg.tokens * full_token_bytes:
            return "length"
        pos += pg.tokens
    w0 = max(0, n - window)
    if pos != n or win.kind != WINDOW_PAGE or win.start != w0 or win.tokens != n - w0:
        return "layout"
    if win.nbytes != win.tokens * swa_token_bytes:
        return "length"
    for pg in h.pages:
        if len(pg.data) != pg.nbytes:
            return "truncated"
        if not pg.intact():
            return "digest"
    return None


class DecodeSide:
    """Drives ``engine`` as a decode replica; ``fingerprint``: ``prefill.kv_fingerprint`` of this
    engine (equal to the prefill replica's when both serve the same checkpoint the same way)."""

    def __init__(self, engine: Engine, fingerprint: str) -> None:
        self.engine = engine
        self.fingerprint = fingerprint
        runner = engine.runner
        self._kinds = [s.kind for s in runner.model.layers]
        self.full_token_bytes = kv_pack.token_bytes(runner.kv, self._kinds, FULL)
        self.swa_token_bytes = kv_pack.token_bytes(runner.kv, self._kinds, SLIDING)
        self.stats = {"adopted": 0, "adopted_tokens": 0, "adopted_kv_bytes": 0}
        self.fallbacks: Counter[str] = Counter()  # reason -> requests that recomputed their prompt
        self._held: dict[str, LockHandle] = {}  # adopted prefixes locked until their request is admitted

    def add(self, req: Request, h: Handover) -> bool:
        """Continue ``req`` (built from the same request the prefill side ran, with its own
        sampling) from ``h``. True when it continues from the KV, False when it recomputes.
        Raises ``InvalidRequest`` as ``Engine.add`` does, and ``ValueError`` for a finished
        hand-over (nothing to decode). A request with structured outputs has its grammar compiled
        here and advanced over the first token before its first step (``Engine``)."""
        if h.finished:
            raise ValueError(f"{h.request_id}: the hand-over finished at its first token")
        assert not req.output_ids, "a request continues from a hand-over once"
        e = self.engine
        reason = check(h, req, self.fingerprint, e.scheduler.config.window, self.full_token_bytes,
                       self.swa_token_bytes)
        if reason is None:
            reason = self._adopt(h, req.req_id)
        self._continue(req, h.first_token, reason)
        return reason is None

    def recompute(self, req: Request, first_token: int, reason: str) -> None:
        """Continue ``req`` after ``first_token`` without a hand-over (none arrived, or none was
        made): it recomputes its prompt, counted under ``reason``."""
        assert not req.output_ids, "a request continues from a hand-over once"
        self._continue(req, first_token, reason)

    def _continue(self, req: Request, first_token: int, fallback: str | None) -> None:
        if fallback is not None:
            self.fallbacks[fallback] += 1
        req.output_ids.append(first_token)
        e = self.engine
        e.add(req)
        e.skip_draw(req.req_id)  # the prefill side drew the first token

    def step(self) -> list[CoreToken]:
        """One engine step, then the locks of adopted prefixes whose request is admitted or gone
        are released."""
        outs = self.engine.step()
        self.release_admitted()
        return outs

    def release_admitted(self) -> None:
        """Unlock the adopted prefixes of requests now running (their own match holds the KV) or
        ended; those still waiting (an L3 lookup, the queue) keep theirs."""
        e = self.engine
        sched = e.scheduler
        for rid in [r for r in self._held
                    if not e.is_live(r) or ((q := sched.requests.get(r)) is not None and q.kv is not None)]:
            sched.kv.tree.unlock(self._held.pop(rid))

    @property
    def num_held(self) -> int:
        return len(self._held)

    def _adopt(self, h: Handover, req_id: str) -> str | None:
        """The pages into the pools and the tree; a reason when there is no room."""
        e = self.engine
        kv = e.scheduler.kv
        n = len(h.prompt_ids)
        w0 = h.pages[-1].start
        got = kv.adopt(n, w0)
        if got is None:
            return "no_room" if kv.enable_prefix_cache else "no_prefix_cache"
        full, swa = got
        if e.tiers is not None:
            e.tiers.run_ops()  # demotions of the slots just handed out copy them down first
        pools = e.runner.kv
        try:
            for pg in h.pages[:-1]:
                kv_pack.unpack(pools, self._kinds, FULL, pg.data, full[pg.start:pg.start + pg.tokens])
            kv_pack.unpack(pools, self._kinds, SLIDING, h.pages[-1].data, swa)
        except Exception:
            kv.give_back(full, swa)
            raise
        keys = list(h.prompt_keys)
        kv.cache_adopted(keys, full, swa, w0)
        self._held[req_id] = kv.tree.lock(kv.tree.match_exact(keys))
        self.stats["adopted"] += 1
        self.stats["adopted_tokens"] += n
        self.stats["adopted_kv_bytes"] += h.kv_bytes
        return None

    @property
    def num_fallbacks(self) -> int:
        return sum(self.fallbacks.values())
