"""Speculative decoding, the engine's side: drafts for running decodes between steps, and the
verification of a step's drafts against the target model's logits.

The scheduler sends a decode's drafts with its input token (one chunk of ``1 + d`` tokens,
causal inside, mixed with prefill chunks and plain decodes in the same forward); the runner
returns the logits of those ``1 + d`` rows; ``verify`` picks the accepted drafts and one more
token; the scheduler keeps the KV of the kept tokens and frees the rest.

What a row's distribution is, at every draft position: the raw logits, the request's
``logit_bias``, its penalties over its tokens and the drafts before that position, its grammar's
mask in the state after those drafts (drafts past the first one the grammar refuses are not
verified), ``min_tokens``' EOS ban for that position's output index, then the sampler's
temperature / min-p / top-k / top-p (inside ``llm_svc.engine.spec.verify``): the distribution a
one-token step would have used at that position.
"""

from __future__ import annotations

import numpy as np
import torch

from llm_svc.engine.grammar import Matcher, draft_masks
from llm_svc.engine.logits_procs import TokenHistory, apply_bias_and_penalties, penalised
from llm_svc.engine.mtp_runner import MTPInput, MTPRunner
from llm_svc.engine.sampler import suppress
from llm_svc.engine.spec import NgramProposer, SpecStats, SpeculativeConfig, verify
from llm_svc.engine.spec.policy import Acceptance, Candidate, make_policy
from llm_svc.engine.textproc import min_tokens_banned
from llm_svc.types.request import Request
from shared.schemas import SamplingParams


class TokenContext:
    """A request's tokens as a growing int64 array (the proposer reads it every step; the
    engine's draft stage keeps one per request)."""

    def __init__(self) -> None:
        self.buf = np.empty(256, dtype=np.int64)
        self.n = 0

    def sync(self, req: Request) -> np.ndarray:
        total = req.num_tokens
        if total < self.n:  # never expected (outputs only grow): start over
            self.n = 0
        if total > self.buf.shape[0]:
            grown = np.empty(max(total, 2 * self.buf.shape[0]), dtype=np.int64)
            grown[:self.n] = self.buf[:self.n]
            self.buf = grown
        if self.n < total:
            self.buf[self.n:total] = req.token_slice(self.n, total)
            self.n = total
        return self.buf[:total]


class Speculator:
    """Proposes drafts and verifies them; counts what was accepted. Drafts come from n-gram
    prompt lookup (``propose``, between steps) or from the checkpoint's MTP layers (``mtp``, an
    ``MTPRunner`` the engine drives after each step's sampling)."""

    def __init__(self, config: SpeculativeConfig, eos_token_ids: list[int], mtp: MTPRunner | None = None,
                 max_draft_tokens: int | None = None):
        self.config = config
        self.k = config.num_speculative_tokens
        self.mtp = mtp
        if config.method == "mtp":
            if mtp is None:
                raise ValueError("speculative method \"mtp\" needs a checkpoint with MTP layers")
            if self.k > mtp.k:
                raise ValueError(f"speculative config: num_speculative_tokens={self.k} must be at most the "
                                 f"checkpoint's {mtp.k} MTP layers (one draft token per layer)")
        self.proposer = (NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, self.k)
                         if config.method == "ngram" else None)
        self.eos_token_ids = list(eos_token_ids)
        self.stats = SpecStats(self.k)
        # drafts per request and step (spec/policy.py), within the step's budget (the scheduler's too)
        self.policy = make_policy(config, mtp=mtp is not None, budget=max_draft_tokens)
        self.acceptance = Acceptance(self.k)

    @staticmethod
    def eligible(sampling: SamplingParams, constrained: bool) -> bool:
        """Whether a request may speculate: every request may (see the module doc)."""
        return True

    def room(self, req: Request, pending: int = 0) -> int:
        """Drafts ``req`` may verify next: at most ``k``, never past ``max_tokens`` (``pending``:
        tokens of this step not yet appended)."""
        return max(0, min(self.k, req.sampling.max_tokens - len(req.output_ids) - pending - 1))

    def mtp_inputs(self, batch, tokens: dict, requests: dict, wants) -> dict[str, MTPInput]:
        """What the MTP layers take of this step, per sequence: its kept rows (a verifying decode:
        the input and the accepted drafts), the committed tokens from K-1 positions before it on
        (with the step's new ones), and whether it wants drafts (``wants(req_id)``)."""
        out = {}
        span = self.mtp.k
        for sf in batch.seqs:
            req = requests.get(sf.req_id)
            if req is None or not wants(sf.req_id):
                continue
            got = tokens.get(sf.req_id)
            new = [] if got is None else list(got) if isinstance(got, list) else [int(got)]
            rows = len(new) if sf.num_drafts else len(sf.token_ids)
            first = max(0, sf.start - span + 1)
            ids = req.token_slice(first, min(req.num_tokens, sf.end + span)) + new
            # a prompt's chunks: only its last rows matter to later drafts (sliding MTP layers)
            useful = self.mtp.useful_from(len(req.prompt_ids)) if sf.end <= len(req.prompt_ids) else 0
            out[sf.req_id] = MTPInput(rows, first, ids, bool(new) and self.room(req, len(new)) > 0, useful)
        return out

    def propose(self, req: Request, ctx: TokenContext, limit: int | None = None) -> list[int]:
        """n-gram drafts for ``req``'s next step (at most ``room`` and ``limit``, the policy's k);
        ``ctx``: its tokens so far."""
        room = self.room(req) if limit is None else min(self.room(req), limit)
        if room < 1 or self.proposer is None:
            return []
        return [int(t) for t in self.proposer.propose(ctx.sync(req), max_new=room)]

    def choose(self, cands: list[Candidate], base_tokens: int, mtp_rows: int,
               requests: dict[str, Request] | None = None) -> dict[str, int]:
        """The policy's drafts per request for the next step. A seeded request always gets its
        ``room``: its samples then do not depend on the machine's timing (the policy's k does),
        so the same seed gives the same tokens run after run, as before."""
        ks = self.policy.choose(cands, base_tokens, mtp_rows)
        if requests is not None:
            for c in cands:
                req = requests.get(c.req_id)
                if req is not None and req.sampling.seed is not None:
                    ks[c.req_id] = c.room
        return ks

    def prompt_layers(self, reqs: list[Request]) -> int:
        """MTP layers worth running over the rows of a step in which no request drafts yet (prompt
        chunks): as many as the policy plans for the decodes these requests become. Those rows'
        MTP KV serves only those drafts, so a batch too large to draft skips them (a loaded burst's
        prefill paid up to K layers over every prompt row for nothing)."""
        cands = [self.candidate(r) for r in reqs]
        return self.policy.planned_layers(cands, len(cands), len(cands)) if cands else 0

    def candidate(self, req: Request, pending: int = 0) -> Candidate:
        return Candidate(req.req_id, self.room(req, pending), self.acceptance.of(req.req_id))

    def observe_step(self, tokens: int, mtp_rows: int, mtp_layers: int, mtp_seconds: float, seconds: float) -> None:
        """A finished step: its query tokens and wall time, and its MTP layers' rows, layer count
        and time (inside ``seconds``); the policy's cost models learn."""
        cost = getattr(self.policy, "cost", None)
        if cost is not None:
            cost.observe(tokens, seconds - mtp_seconds)
            self.policy.mtp_cost.observe(mtp_rows, mtp_layers, mtp_seconds)

    def verify(self, logits: torch.Tensor, drafts: list[int], sampling: SamplingParams, num_outputs: int,
               generator: torch.Generator | None, history: TokenHistory | None = None,
               matcher: Matcher | None = None, req_id: str | None = None) -> list[int] | None:
        """``logits [d + 1, V]`` raw rows of one request (row j: the position of ``drafts[j]``,
        row d: the one after the last draft) -> the accepted drafts and one more token; None when
        its grammar allows no token at all at the first position. ``num_outputs``: the request's
        output tokens before this step (for ``min_tokens``); ``history``: its penalties' state
        (penalised requests); ``matcher``: its grammar's (left unchanged here)."""
        d = len(drafts)
        x = logits
        if matcher is not None:  # masked before the bias: rows past the refused draft are cut
            x, d = draft_masks(x, matcher, drafts)
            drafts = drafts[:d]
            if torch.isneginf(x[0]).all():
                return None
        hist = None
        if history is not None and penalised(sampling):
            hist = [history]
            for t in drafts:
                hist.append(hist[-1].plus(t))
        x = apply_bias_and_penalties(x, [sampling] * (d + 1), hist or [None] * (d + 1))
        if sampling.min_tokens:
            banned = {j: min_tokens_banned(sampling, num_outputs + j, self.eos_token_ids) for j in range(d + 1)}
            y = suppress(x, banned)
            if matcher is not None:  # the grammar can only end here: it wins over min_tokens (as one token at a time)
                dead = torch.isneginf(y).all(dim=-1) & ~torch.isneginf(x).all(dim=-1)
                y[dead] = x[dead]
            x = y
        out = verify(x, drafts, sampling, generator)
        self.stats.observe(len(drafts), len(out) - 1)
        if req_id is not None:
            self.acceptance.observe(req_id, len(drafts), len(out) - 1)
        return out
