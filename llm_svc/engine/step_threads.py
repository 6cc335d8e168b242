"""How many torch threads one engine step runs with, by the step's size (CPU).

A big step (prefill chunks: GEMMs of hundreds of rows, milliseconds each) gains from every
core; a small one (decodes: hundreds of sub-millisecond ops) gains little, and each of its
parallel regions may pay a wake-up of sleeping OpenMP workers (see
``llm_svc.core.process.core_env``) and takes a core from the front and the gateway, which
stream its tokens. So steps of fewer than ``min_tokens`` tokens run on ``small`` threads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepThreads:
    large: int  # threads of a step of at least ``min_tokens`` tokens
    small: int = 1  # threads of a smaller step
    min_tokens: int = 64

    def __post_init__(self) -> None:
        if self.large < 1 or self.small < 1 or self.min_tokens < 1:
            raise ValueError(f"StepThreads needs positive counts, got {self}")

    def threads_for(self, num_tokens: int) -> int:
        return self.large if num_tokens >= self.min_tokens else self.small

    def apply(self, num_tokens: int) -> int:
        """Set torch's thread count for a step of ``num_tokens`` tokens (a no-op when unchanged)."""
        n = self.threads_for(num_tokens)
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return n
