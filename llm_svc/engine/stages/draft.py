"""Drafts for the next step of every request of a batch now decoding: from the checkpoint's MTP
layers (``mtp``, before the scheduler's postprocess: the window's slots are still held) or by
n-gram prompt lookup (``propose``, after it).

Per request: its tokens as n-gram lookup reads them (``TokenContext``), started at its first
proposal."""

from __future__ import annotations

from llm_svc.engine.live import Live
from llm_svc.engine.model_runner import ModelRunner
from llm_svc.engine.speculate import Speculator, TokenContext
from llm_svc.types.request import ForwardBatch, Request


class Draft:
    def __init__(self, speculator: Speculator | None, runner: ModelRunner, live: dict[str, Live]):
        self.speculator = speculator
        self.runner = runner
        self.live = live

    @staticmethod
    def release(lv: Live) -> None:
        lv.ngram = None

    def may_speculate(self, req_id: str) -> bool:
        lv = self.live.get(req_id)
        return lv is not None and self.speculator.eligible(lv.req.sampling, lv.matcher is not None)

    def mtp(self, batch: ForwardBatch, tokens: dict, requests: dict[str, Request]) -> dict[str, list[int]] | None:
        """The MTP layers' step over this batch: their drafts by request (None without MTP)."""
        spec = self.speculator
        if spec is None or spec.mtp is None:
            return None
        inputs = spec.mtp_inputs(batch, tokens, requests, self.may_speculate)
        return spec.mtp.step(batch, self.runner.last_hidden, inputs)

    def propose(self, batch: ForwardBatch, mtp_drafts: dict[str, list[int]] | None,
                requests: dict[str, Request]) -> None:
        """After the scheduler's postprocess: each decoding request gets its drafts
        (``spec_tokens``), the MTP layers' (at most ``room``) or n-gram lookup's."""
        spec = self.speculator
        if mtp_drafts is not None:
            for rid, d in mtp_drafts.items():
                req = requests.get(rid)
                if req is not None and req.num_tokens - req.num_computed == 1:
                    req.spec_tokens = d[:spec.room(req)]
        elif spec is not None:
            for sf in batch.seqs:
                req = requests.get(sf.req_id)
                if req is None or req.num_tokens - req.num_computed != 1 or not self.may_speculate(sf.req_id):
                    continue
                lv = self.live[sf.req_id]
                if lv.ngram is None:
                    lv.ngram = TokenContext()
                req.spec_tokens = spec.propose(req, lv.ngram)
