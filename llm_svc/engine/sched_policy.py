"""Admission order policies: which waiting requests the scheduler tries to admit first."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from llm_svc.engine.request import Request


class AdmissionPolicy(ABC):
    """Orders the waiting queue. Preempted requests (already started once) always come first."""

    @abstractmethod
    def order(self, waiting: Sequence[Request], now: float, cached_len: Callable[[list[int]], int]) -> list[Request]:
        """Requests in the order admission should try them; ``cached_len(keys)`` estimates the
        cache hit of a prompt without side effects."""


class FCFSPolicy(AdmissionPolicy):
    def order(self, waiting, now, cached_len):
        return sorted(waiting, key=lambda r: (r.num_preemptions == 0, r.arrival_time))


class ComputeAwarePolicy(AdmissionPolicy):
    """Fewest uncached tokens first, minus an aging credit so long prompts are not starved:
    score = uncached_tokens - aging_tokens_per_s * seconds_waited. Looks at the first
    ``window`` waiting requests only (the tree lookups are not free)."""

    def __init__(self, aging_tokens_per_s: float = 2000.0, window: int = 64) -> None:
        self.aging = aging_tokens_per_s
        self.window = window

    def order(self, waiting, now, cached_len):
        head = sorted(waiting, key=lambda r: (r.num_preemptions == 0, r.arrival_time))
        pre = [r for r in head if r.num_preemptions]
        rest = [r for r in head if not r.num_preemptions]
        considered, tail = rest[: self.window], rest[self.window:]

        def score(r: Request) -> float:
            uncached = r.num_tokens - cached_len(r.all_keys[:-1])
            return uncached - self.aging * (now - r.arrival_time)

        return pre + sorted(considered, key=score) + tail


POLICIES: dict[str, Callable[[], AdmissionPolicy]] = {
    "fcfs": FCFSPolicy,
    "compute_aware": ComputeAwarePolicy,
}


def make_policy(name: str) -> AdmissionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; choose one of {sorted(POLICIES)}") from None
