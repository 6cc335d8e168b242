"""The prefill side of an engine: requests run to their first token, then leave as ``Handover``s.

``PrefillSide.add`` queues a request capped at one output token; when the engine's step emits it,
the request has finished and its prompt's KV sits in the prefix tree (the scheduler caches a
prompt when its prefill completes and again when the request leaves, the last ``W + 1`` positions'
SWA kept). ``step`` exports it from there in the same call, before any later schedule could evict
it: the tree's match is locked, read page by page (``kv_pack``), and unlocked. The request's
slots are the tree's again, so a later prompt sharing the prefix hits it here as usual.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from llm_svc.attention import FULL, SLIDING
from llm_svc.disagg.messages import FULL_PAGE, WINDOW_PAGE, Handover, KVPage
from llm_svc.engine.engine import Engine
from llm_svc.engine.textproc import token_finish_reason
from llm_svc.offload import kv_pack
from llm_svc.types.messages import CoreToken
from llm_svc.types.request import Request
from shared.schemas import SamplingParams


def kv_fingerprint(engine: Engine, model_id: str = "") -> str:
    """What a hand-over's KV must agree on between the two replicas: the checkpoint's identity
    (``model_id``, e.g. ``core.build.model_identity``), every layer's kind and pool shape, the
    pools' dtype and the window."""
    runner = engine.runner
    layers = [(s.kind, tuple(kv.k.shape[::2]), kv.v.shape[2]) for s, kv in zip(runner.model.layers, runner.kv)]
    blob = json.dumps({"model": model_id, "layers": layers, "dtype": str(runner.kv_dtype),
                       "window": engine.scheduler.config.window}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class PrefillConfig:
    """``page_tokens``: full-layer KV per page (the Redis tier's page size is the natural pick).
    ``fingerprint``: ``kv_fingerprint`` of the engine."""

    page_tokens: int
    fingerprint: str

    def __post_init__(self) -> None:
        if self.page_tokens < 1:
            raise ValueError(f"page_tokens must be >= 1, got {self.page_tokens}")
        if not self.fingerprint:
            raise ValueError("a hand-over needs the engine's KV fingerprint")


@dataclass
class PrefillStep:
    """One step's results: ``handovers`` ready to send, ``failed`` (errors and aborts of requests
    that never reached their first token, as the engine reported them), and ``outputs``: the
    engine's outputs of requests added to it directly (a ``both`` replica serves those as usual)."""

    handovers: list[Handover] = field(default_factory=list)
    failed: list[CoreToken] = field(default_factory=list)
    outputs: list[CoreToken] = field(default_factory=list)
    finish_reasons: dict[str, str] = field(default_factory=dict)  # request id -> why a finished hand-over ended
    firsts: dict[str, CoreToken] = field(default_factory=dict)  # request id -> the engine's first output (logprobs)


class PrefillSide:
    """Drives ``engine`` as a prefill replica. Single-threaded, like the engine."""

    def __init__(self, engine: Engine, config: PrefillConfig) -> None:
        self.engine = engine
        self.config = config
        self._pending: dict[str, tuple[Request, SamplingParams]] = {}  # id -> (request, its own sampling)
        self.stats = {"handovers": 0, "handovers_without_kv": 0, "handover_kv_bytes": 0}

    def add(self, req: Request) -> None:
        """Queue ``req`` to run to its first token (``Engine.add``'s errors propagate)."""
        sampling = req.sampling
        req.sampling = sampling.model_copy(update={"max_tokens": 1})
        self.engine.add(req)
        self._pending[req.req_id] = (req, sampling)

    def abort(self, req_id: str) -> None:
        self.engine.abort(req_id)

    def has_work(self) -> bool:
        return self.engine.has_work()

    def step(self) -> PrefillStep:
        """One engine step; the requests that reached their first token leave as hand-overs,
        exported now (before a later schedule could evict their prompt's KV)."""
        out = PrefillStep()
        for t in self.engine.step():
            got = self._pending.pop(t.request_id, None)
            if got is None:
                out.outputs.append(t)
                continue
            if t.token_id is None or t.error is not None:
                out.failed.append(t)
                continue
            req, sampling = got
            req.sampling = sampling
            out.firsts[req.req_id] = t
            reason = token_finish_reason(t.token_id, 1, sampling, req.eos_token_ids)
            if reason is not None:
                out.finish_reasons[req.req_id] = reason
            out.handovers.append(self._export(req, t.token_id, reason is not None))
        return out

    def _export(self, req: Request, first: int, finished: bool) -> Handover:
        cfg = self.config
        keys = req.prompt_keys
        base = dict(request_id=req.req_id, prompt_ids=list(req.prompt_ids), first_token=first,
                    fingerprint=cfg.fingerprint, page_tokens=cfg.page_tokens,
                    window=self.engine.scheduler.config.window,
                    keys=None if keys == req.prompt_ids else list(keys))
        if finished:
            return Handover(**base, finished=True)
        pages = self._pages(keys)
        self.stats["handovers"] += 1
        if not pages:
            self.stats["handovers_without_kv"] += 1
        h = Handover(**base, pages=pages)
        self.stats["handover_kv_bytes"] += h.kv_bytes
        return h

    def _pages(self, keys: list[int]) -> list[KVPage]:
        """The prompt's KV from the prefix tree, or [] when the tree does not hold all of it on
        the device (no prefix cache)."""
        kv = self.engine.scheduler.kv
        if not kv.enable_prefix_cache:
            return []
        tree = kv.tree
        n = len(keys)
        m = tree.match_prefix(keys)
        if m.length < n or m.needs_load:
            return []
        h = tree.lock(m)
        try:
            runner = self.engine.runner
            kinds = [s.kind for s in runner.model.layers]
            p, w0 = self.config.page_tokens, max(0, n - kv.window)
            pages = [KVPage.of(FULL_PAGE, a, min(p, n - a), kv_pack.pack(runner.kv, kinds, FULL, m.full_slots[a:a + p]))
                     for a in range(0, n, p)]
            pages.append(KVPage.of(WINDOW_PAGE, w0, n - w0, kv_pack.pack(runner.kv, kinds, SLIDING, m.swa_slots[w0:])))
        finally:
            tree.unlock(h)
        return pages
