"""How many torch threads one engine step runs with, by the step's size (CPU).

A big step (prefill chunks: GEMMs of hundreds of rows, milliseconds each) gains from every
core; a small one (decodes: hundreds of sub-millisecond ops) gains little, and each of its
parallel regions may pay a wake-up of sleeping OpenMP workers (see
``llm_svc.core.process.core_env``) and takes a core from the front and the gateway, which
stream its tokens. So steps of fewer than ``min_tokens`` tokens run on ``small`` threads.

The few-row linear kernel (``llm_svc.models.cpu_gemv``: a decode step's linears and routed
experts, bound by streaming the weights) runs on ``gemv`` threads of its own elastic pool (every
core by default): the step's thread runs the work itself and the pool's helpers join while they
are on a core, so when the front, the gateway or a client takes the other core the step runs on
alone instead of waiting for it at an OpenMP barrier. Only while the machine has a core to spare
(``OtherLoad``: the CPU time every other process took over the last second, from ``/proc/stat``
less this process's own, at most ``cores - gemv + 0.75`` cores); on a box busy with other work
(a test suite, a benchmark beside the services) a helper that claimed a chunk and lost its core
would hold the step for a time slice, so the kernel runs on one thread there. Measured on the
2-core AVX-512 EPYC (vs_vllm MiMo, 4 chats in flight through the service, the core's step time
by its 4 decodes, median): OpenMP on one thread 13.4 ms, on two 13.4 ms, the pool on two 10.7.
The attention kernels run their work items on the same pool with the same count
(``cpu_paged.use_pool``), or on Python threads while it has one thread.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from llm_svc.attention import cpu_paged
from llm_svc.models import cpu_gemv
from shared.cpus import usable_cpus


def _cpu_sample() -> tuple[float, float, float] | None:
    """(wall s, CPU s every process on the machine was busy, CPU s of this process) now; None
    where ``/proc/stat`` cannot be read."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != b"cpu" or len(fields) < 8:
        return None
    # user nice system idle iowait irq softirq steal ...: busy = all but idle and iowait
    jiffies = [int(x) for x in fields[1:9]]
    busy = sum(jiffies) - jiffies[3] - jiffies[4]
    return time.monotonic(), busy / _CLK_TCK, time.process_time()


_CLK_TCK = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0


@dataclass
class OtherLoad:
    """Cores' worth of CPU the rest of the machine (every process but this one) used over the
    last ``interval`` seconds, re-measured at most once per ``interval``. Unknown (no sample yet,
    or no ``/proc/stat``): ``inf``, read as busy."""

    interval: float = 1.0
    sample: Callable[[], tuple[float, float, float] | None] = _cpu_sample
    _last: tuple[float, float, float] | None = None
    _value: float = float("inf")

    def cores(self) -> float:
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < self.interval:
            return self._value
        cur = self.sample()
        if cur is None:
            self._last, self._value = None, float("inf")
            return self._value
        if self._last is not None and cur[0] > self._last[0]:
            wall = cur[0] - self._last[0]
            self._value = max(0.0, (cur[1] - self._last[1]) - (cur[2] - self._last[2])) / wall
        self._last = cur
        return self._value


def allowed_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by its cgroup's CPU quota (a
    container's ``cpus`` limit; ``shared.cpus``)."""
    return usable_cpus()


@dataclass(frozen=True)
class StepThreads:
    large: int  # threads of a step of at least ``min_tokens`` tokens
    small: int = 1  # threads of a smaller step
    min_tokens: int = 64
    gemv: int = 1  # few-row kernel threads while a core is spare (one otherwise)
    others: OtherLoad = field(default_factory=OtherLoad, compare=False, repr=False)
    cpus: int = field(default_factory=allowed_cpus, compare=False, repr=False)

    def __post_init__(self) -> None:
        if min(self.large, self.small, self.min_tokens, self.gemv) < 1:
            raise ValueError(f"StepThreads needs positive counts, got {self}")

    def threads_for(self, num_tokens: int) -> int:
        return self.large if num_tokens >= self.min_tokens else self.small

    def spare_core(self) -> bool:
        """Whether ``gemv`` threads would not have to fight other processes for their cores:
        the rest of the machine used at most ``cpus - gemv + 0.75`` cores over the last second."""
        return self.spare_for(self.gemv)

    def spare_for(self, threads: int) -> bool:
        """Whether ``threads`` threads would have their cores: the rest of the machine used at
        most ``cpus - threads + 0.75`` cores over the last second."""
        return self.others.cores() <= self.cpus - threads + 0.75

    def gemv_threads(self) -> int:
        return self.gemv if self.gemv > 1 and self.spare_core() else 1

    def apply(self, num_tokens: int) -> int:
        """Set torch's thread count for a step of ``num_tokens`` tokens (a no-op when unchanged)
        and the few-row kernel's; returns torch's."""
        n = self.threads_for(num_tokens)
        # torch's OpenMP regions wait at barriers for every thread: one that lost its core to
        # another process holds the whole GEMM for a time slice. Measured on the 2-core AMX Xeon
        # with a training run on one core (vs_vllm MiMo at bfloat16, 1,024-token prefill):
        # 0.52-0.66 s on two threads, 0.35 on one; with oneDNN's AMX GEMMs 1.0-2.4 s on two, 0.20 on one
        if n > 1 and not self.spare_for(n):
            n = 1
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        gemv = self.gemv_threads()
        cpu_gemv.set_threads(gemv)
        cpu_paged.use_pool(*cpu_gemv.pool(gemv))
        return n
