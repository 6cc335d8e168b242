"""How many torch threads one engine step runs with, by the step's size (CPU).

A big step (prefill chunks: GEMMs of hundreds of rows, milliseconds each) gains from every
core; a small one (decodes: hundreds of sub-millisecond ops) gains little, and each of its
parallel regions may pay a wake-up of sleeping OpenMP workers (see
``llm_svc.core.process.core_env``) and takes a core from the front and the gateway, which
stream its tokens. So steps of fewer than ``min_tokens`` tokens run on ``small`` threads.

The few-row linear kernel (``llm_svc.models.cpu_gemv``: a decode step's linears, bound by
streaming the weights) gets its own count by the step's sequences: ``gemv_few`` threads for a step
of at most ``few_seqs`` sequences, ``gemv`` otherwise. With one or two sequences the front and
the gateway stream few tokens a second and the second core is free, so two threads stream the
weights nearly twice as fast; with more, the core shares the machine with that streaming and an
OpenMP barrier waits whenever its other thread is descheduled. And only while the machine has a
core to spare (1-minute load average at most ``large - 0.5``, read at most once a second): on a
box shared with other busy processes (a test suite, a benchmark beside the services) every one
of a step's ~40 barriers would wait for a time slice. Measured on the 2-core AVX2 EPYC
(vs_vllm MiMo, in-process decode step, one torch thread): one sequence 11.7 -> 7.6 ms with two
kernel threads, two 14.4 -> 9.4, four 17.6 -> 13.4; through the service (`vs_vllm --quick`,
chat) two threads everywhere took the Poisson mode's ITL p50 from 1.74x vLLM's to 1.20x but the
4-in-flight mode's from 0.99x to 1.27x.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from llm_svc.models import cpu_gemv


@dataclass(frozen=True)
class StepThreads:
    large: int  # threads of a step of at least ``min_tokens`` tokens
    small: int = 1  # threads of a smaller step
    min_tokens: int = 64
    gemv: int = 1  # few-row kernel threads of a step of more than ``few_seqs`` sequences
    gemv_few: int = 1  # ... and of a step of at most ``few_seqs``
    few_seqs: int = 2
    _load: list[float] = field(default_factory=lambda: [0.0, -1.0], compare=False, repr=False)  # [value, read at]

    def __post_init__(self) -> None:
        if min(self.large, self.small, self.min_tokens, self.gemv, self.gemv_few) < 1 or self.few_seqs < 0:
            raise ValueError(f"StepThreads needs positive counts, got {self}")

    def threads_for(self, num_tokens: int) -> int:
        return self.large if num_tokens >= self.min_tokens else self.small

    def spare_core(self) -> bool:
        """Whether the machine has a core the step's own threads would not have to fight for:
        the 1-minute load average (read at most once a second) at most ``large - 0.5``."""
        now = time.monotonic()
        if now - self._load[1] >= 1.0:
            try:
                self._load[0] = os.getloadavg()[0]
            except OSError:  # no load average here: assume a busy machine
                self._load[0] = float("inf")
            self._load[1] = now
        return self._load[0] <= self.large - 0.5

    def gemv_for(self, num_seqs: int) -> int:
        if num_seqs <= self.few_seqs and self.gemv_few != self.gemv and self.spare_core():
            return self.gemv_few
        return self.gemv

    def apply(self, num_tokens: int, num_seqs: int | None = None) -> int:
        """Set torch's thread count for a step of ``num_tokens`` tokens (a no-op when unchanged)
        and, given its ``num_seqs``, the few-row kernel's; returns torch's."""
        n = self.threads_for(num_tokens)
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        if num_seqs is not None:
            cpu_gemv.set_threads(self.gemv_for(num_seqs))
        return n
