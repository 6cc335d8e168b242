"""Drafts for the next step of every request of a batch now decoding: from the checkpoint's MTP
layers (``mtp``, before the scheduler's postprocess: the window's slots are still held) or by
n-gram prompt lookup (``propose``, after it).

Per request: its tokens as n-gram lookup reads them (``TokenContext``), started at its first
proposal."""

from __future__ import annotations

import time

from llm_svc.engine.live import Live
from llm_svc.engine.model_runner import ModelRunner
from llm_svc.engine.speculate import Speculator, TokenContext
from llm_svc.types.request import ForwardBatch, Request


class Draft:
    def __init__(self, speculator: Speculator | None, runner: ModelRunner, live: dict[str, Live]):
        self.speculator = speculator
        self.runner = runner
        self.live = live
        self._ks: dict[str, int] = {}  # the policy's drafts per request for the next step
        # this step's MTP run, for the policy's cost model: rows, layers, seconds
        self.mtp_rows, self.mtp_layers, self.mtp_seconds = 0, 0, 0.0

    def release(self, lv: Live) -> None:
        lv.ngram = None
        if self.speculator is not None:
            self.speculator.acceptance.drop(lv.req.req_id)

    def may_speculate(self, req_id: str) -> bool:
        lv = self.live.get(req_id)
        return lv is not None and self.speculator.eligible(lv.req.sampling, lv.matcher is not None)

    def mtp(self, batch: ForwardBatch, tokens: dict, requests: dict[str, Request]) -> dict[str, list[int]] | None:
        """The MTP layers' step over this batch: their drafts by request (None without MTP)."""
        spec = self.speculator
        self.mtp_rows, self.mtp_layers, self.mtp_seconds = 0, 0, 0.0
        if spec is None or spec.mtp is None:
            return None
        inputs = spec.mtp_inputs(batch, tokens, requests, self.may_speculate)
        cands = [spec.candidate(requests[rid], len(_as_list(tokens.get(rid)))) for rid, x in inputs.items() if x.draft]
        rows = sum(x.rows for x in inputs.values())
        self._ks = spec.choose(cands, _base_tokens(batch), rows, requests)
        # as many layers as the longest draft asked for (none when no decode drafts: a loaded step
        # saves them); when no request could draft yet (prompt chunks), as many as the policy plans
        # for the decodes they become (their KV of a prompt's rows serves those drafts only)
        layers = (max(self._ks.values(), default=0) if cands
                  else spec.prompt_layers([requests[rid] for rid in inputs]))
        t0 = time.perf_counter()
        out = spec.mtp.step(batch, self.runner.last_hidden, inputs, max_layers=layers)
        self.mtp_rows, self.mtp_layers, self.mtp_seconds = rows, layers, time.perf_counter() - t0
        return out

    def propose(self, batch: ForwardBatch, mtp_drafts: dict[str, list[int]] | None,
                requests: dict[str, Request]) -> None:
        """After the scheduler's postprocess: each decoding request gets its drafts
        (``spec_tokens``), the MTP layers' (at most ``room``) or n-gram lookup's."""
        spec = self.speculator
        if mtp_drafts is not None:
            for rid, d in mtp_drafts.items():
                req = requests.get(rid)
                if req is not None and req.num_tokens - req.num_computed == 1:
                    req.spec_tokens = d[:min(spec.room(req), self._ks.get(rid, 0))]
        elif spec is not None:
            decoding = [requests[sf.req_id] for sf in batch.seqs if sf.req_id in requests
                        and requests[sf.req_id].num_tokens - requests[sf.req_id].num_computed == 1
                        and self.may_speculate(sf.req_id)]
            ks = spec.choose([spec.candidate(r) for r in decoding], _base_tokens(batch), 0, requests)
            for req in decoding:
                lv = self.live[req.req_id]
                if lv.ngram is None:
                    lv.ngram = TokenContext()
                req.spec_tokens = spec.propose(req, lv.ngram, ks.get(req.req_id, 0))


def _as_list(got) -> list:
    return [] if got is None else got if isinstance(got, list) else [got]


def _base_tokens(batch: ForwardBatch) -> int:
    """This step's query tokens less its drafts: the next step's without drafts, as an estimate."""
    return batch.num_tokens - sum(sf.num_drafts for sf in batch.seqs)
