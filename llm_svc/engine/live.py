"""What the engine holds for one request: its record (``Live``), from ``Engine.add`` to its last
output, and the admission waits before the scheduler has it (a grammar compiling, an L3 lookup).

Everything here is released in one place, ``Engine._release``: an abort, a failure, a finish
and a request the scheduler dropped on its own all go through it.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch

from llm_svc.engine.grammar import Matcher
from llm_svc.engine.logits_procs import TokenHistory
from llm_svc.engine.prompt_logprobs import PromptScores
from llm_svc.engine.speculate import TokenContext
from llm_svc.types.request import Request


@dataclass
class Live:
    """One live request. Each field past ``generator`` is one stage's state
    (``llm_svc.engine.stages``): that stage creates it and releases it."""

    req: Request
    generator: torch.Generator | None  # seeded sampling
    history: TokenHistory | None = None  # penalties: prompt tokens and output counts (penalised requests)
    matcher: Matcher | None = None  # grammar_mask: the grammar's state (structured outputs)
    prompt: PromptScores | None = None  # logprobs: scored during prefill, sent with the first output
    ngram: TokenContext | None = None  # draft: the request's tokens as n-gram lookup reads them


@dataclass
class Compiling:
    """A structured request waiting for its grammar (queued once it is compiled)."""

    req: Request
    future: Future


@dataclass
class Prefetch:
    """A request waiting for its L3 lookup (queued once it is back or late)."""

    req: Request
    future: Future
    deadline: float
