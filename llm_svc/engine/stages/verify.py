"""Speculative decoding's verification in a step: a decode that sent ``d`` drafts gets back the
accepted drafts and one more token, from the same distribution a one-token step would have used
at each position (``Speculator.verify``: penalties, grammar mask, ``min_tokens``, sampler), then
through its grammar. No per-request state of its own: it reads the penalties' and the grammar's."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from llm_svc.engine.live import Live
from llm_svc.engine.speculate import Speculator
from llm_svc.engine.stages.grammar_mask import BROKEN, STUCK, GrammarMask
from llm_svc.engine.stages.penalties import Penalties
from llm_svc.types.request import Request

log = logging.getLogger(__name__)


@dataclass
class Verified:
    tokens: list[int]  # the accepted drafts and one more token (cut where the grammar completes)
    done: bool = False  # its grammar is complete: the request stops with the last one
    error: tuple[str, int] | None = None  # (message, status): the request fails alone


class Verify:
    def __init__(self, speculator: Speculator | None):
        self.speculator = speculator

    def run(self, rid: str, lv: Live, req: Request, rows: torch.Tensor, drafts: list[int]) -> Verified:
        """``rows [d + 1, V]``: the raw logits of one request's input token and its ``d`` drafts;
        ``req``: the scheduler's view of it."""
        Penalties.start(lv, req, rows.shape[-1], rows.device)
        toks = self.speculator.verify(rows, drafts, lv.req.sampling, len(req.output_ids), lv.generator,
                                      lv.history, lv.matcher, req_id=rid)
        if toks is None:
            return Verified([], error=(STUCK, 400))
        done = False
        if lv.matcher is not None:
            toks, done, ok = GrammarMask.advance_burst(lv.matcher, toks)
            if not ok:
                log.error("request %s: a verified token breaks its grammar", rid)
                return Verified([], error=(BROKEN, 500))
        return Verified(toks, done)
