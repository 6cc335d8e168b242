"""Structured outputs in a step: each constrained row masked by its request's grammar, and each
grammar advanced by the tokens its request took.

Per request: its ``Matcher``, started once its grammar is compiled (``Engine._admit_compiled``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from llm_svc.engine.grammar import Matcher, apply_grammars
from llm_svc.engine.live import Live

log = logging.getLogger(__name__)

# a request's fault (a grammar this vocabulary cannot write), failed alone with 400
STUCK = ("the structured output cannot continue: its grammar allows no token of this model's vocabulary "
         "here (e.g. a character the tokenizer cannot write)")
# never expected (the mask forbids such a token), failed alone with 500
BROKEN = "the sampled token broke the request's grammar; retry it"


class GrammarMask:
    @staticmethod
    def start(lv: Live, matcher: Matcher) -> None:
        """``matcher``: the request's grammar, compiled (``GrammarCache.matcher``)."""
        lv.matcher = matcher

    @staticmethod
    def release(lv: Live) -> None:
        lv.matcher = None

    @staticmethod
    def mask(x: torch.Tensor, rows: torch.Tensor, ids: Sequence[str],
             lives: Sequence[Live]) -> tuple[torch.Tensor, list[str]]:
        """x [N, V] (``rows`` biased and penalised, or ``rows`` itself: then copied) -> x with
        each constrained row's forbidden tokens at -inf, and the requests whose grammar allows no
        token at all."""
        matchers = [lv.matcher for lv in lives]
        x = apply_grammars(x.clone() if x is rows else x, matchers)
        dead = torch.isneginf(x).all(dim=-1).tolist()
        return x, [ids[n] for n, m in enumerate(matchers) if m is not None and dead[n]]

    @staticmethod
    def keep_ends(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y``: masked ``x`` with ``min_tokens``' ban. A row the ban leaves empty gets ``x``'s
        row back: the grammar can only end here, and it wins over ``min_tokens``."""
        dead = torch.isneginf(y).all(dim=-1) & ~torch.isneginf(x).all(dim=-1)
        y[dead] = x[dead]
        return y

    @staticmethod
    def advance(ids: Sequence[str], lives: Sequence[Live], sampled: Sequence[int],
                stuck: set[str]) -> tuple[set[str], list[str]]:
        """Each constrained request takes its token: (those whose grammar is complete, those whose
        token the grammar refused: never expected, as the mask forbids it; failed alone)."""
        done, broken = set(), []
        for rid, lv, tok in zip(ids, lives, sampled):
            if lv.matcher is None or rid in stuck:
                continue
            if not lv.matcher.accept(tok):
                log.error("request %s: token %d breaks its grammar", rid, tok)
                broken.append(rid)
            elif lv.matcher.terminated:
                done.add(rid)
        return done, broken

    @staticmethod
    def advance_burst(m: Matcher, toks: list[int]) -> tuple[list[int], bool, bool]:
        """A verified burst through one request's grammar: (the tokens up to the one that
        completes it, completed, every token accepted)."""
        for n, t in enumerate(toks):
            if not m.accept(t):
                return toks[:n], False, False
            if m.terminated:
                return toks[:n + 1], True, True
        return toks, False, True
