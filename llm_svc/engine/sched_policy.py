"""Admission order policies: which waiting requests the scheduler tries to admit first.

The scheduler asks ``policy.order(waiting, now, cached_len)`` at each step that has room to
admit, and tries the requests in that order until one does not fit (it then stops, so the
policy's head is never overtaken for lack of KV room). ``now`` is on the clock of
``Request.arrival_time``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from llm_svc.types.request import Request
from shared.registry import Registry


class AdmissionPolicy(ABC):
    """Orders the waiting queue. Preempted requests (already started once) always come first."""

    @abstractmethod
    def order(self, waiting: Sequence[Request], now: float, cached_len: Callable[[list[int]], int]) -> list[Request]:
        """Requests in the order admission should try them; ``cached_len(keys)`` estimates the
        cache hit of a prompt without side effects."""


# name (the ``schedule_policy`` setting) -> policy class, built with the policy's parameters
POLICIES: Registry[Callable[..., AdmissionPolicy]] = Registry("scheduling policy")


def _arrival_order(waiting: Sequence[Request]) -> list[Request]:
    """Preempted first, then by vLLM-style ``priority`` (lower first), then by arrival."""
    return sorted(waiting, key=lambda r: (r.num_preemptions == 0, r.sampling.priority, r.arrival_time))


@POLICIES.register("fcfs")
class FCFSPolicy(AdmissionPolicy):
    def order(self, waiting, now, cached_len):
        return _arrival_order(waiting)


def uncached_tokens(req: Request, cached_len: Callable[[list[int]], int]) -> int:
    """Tokens admission would have to compute now: the sequence minus its prefix-cache hit (the
    scheduler matches all keys but the last, which always runs to produce logits)."""
    return req.num_tokens - cached_len(req.all_keys[:-1])


@POLICIES.register("compute_aware")
class ComputeAwarePolicy(AdmissionPolicy):
    """Fewest real (uncached) tokens to compute first, with aging so nothing starves.

    score = min(uncached, aging * max_wait_s) - aging * seconds_waited, lowest first. The
    uncached count comes from a side-effect-free prefix-cache lookup at ordering time, so a long
    prompt whose prefix is cached is cheap. Dividing by ``aging`` gives an equivalent,
    time-invariant key: ``arrival_time + min(uncached / aging, max_wait_s)``, i.e. a request is
    ordered as if it had arrived ``uncached / aging`` seconds later, at most ``max_wait_s``
    later. So a request is never overtaken by one that arrived more than ``max_wait_s`` after
    it: its wait is bounded by ``max_wait_s`` plus the service time of what arrived before that.

    ``aging_tokens_per_s``: how much uncached work one second of waiting makes up for; a
    fraction of the engine's prefill throughput (the smaller, the closer to shortest-job-first).
    Only the ``window`` oldest waiting requests are scored (each score is a tree lookup); the
    rest follow in arrival order.
    """

    def __init__(self, aging_tokens_per_s: float = 4000.0, max_wait_s: float = 10.0, window: int = 64) -> None:
        if aging_tokens_per_s <= 0 or max_wait_s < 0 or window < 1:
            raise ValueError("ComputeAwarePolicy needs aging_tokens_per_s > 0, max_wait_s >= 0, window >= 1")
        self.aging = aging_tokens_per_s
        self.max_wait_s = max_wait_s
        self.window = window

    def deadline(self, req: Request, cached_len: Callable[[list[int]], int]) -> float:
        """The request's sort key (seconds, on the arrival clock)."""
        return req.arrival_time + min(uncached_tokens(req, cached_len) / self.aging, self.max_wait_s)

    def order(self, waiting, now, cached_len):
        head = _arrival_order(waiting)
        pre = [r for r in head if r.num_preemptions]
        rest = [r for r in head if not r.num_preemptions]
        considered, tail = rest[: self.window], rest[self.window:]
        # sorted() is stable: equal keys keep arrival order
        return pre + sorted(considered, key=lambda r: (r.sampling.priority, self.deadline(r, cached_len))) + tail


def make_policy(name: str, **params) -> AdmissionPolicy:
    """The policy called ``name``; ``params`` go to its constructor."""
    return POLICIES.get(name)(**params)
