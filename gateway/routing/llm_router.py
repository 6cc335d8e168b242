"""LLM replica choice.  Policies share one small interface and live in a registry (``ROUTERS``):

* ``round_robin`` - the baseline,
* ``cache_aware`` - the replica whose (approximate) prefix cache holds the longest prefix of the
  prompt, unless it is overloaded compared with the least-loaded replica;
* ``EventRouter`` - ``cache_aware`` on what the replicas report they hold (KV events, one view
  for every gateway), with this gateway's own recent sends on top until their events arrive.

A router only does bookkeeping (in-flight counts, per-replica LRU of block keys); it never
talks to a replica."""

from __future__ import annotations

import itertools
import time
from abc import ABC, abstractmethod
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from shared.prefix_keys import leading_held
from shared.registry import Registry


class LLMRouter(ABC):
    """Chooses a replica for a prompt; callers wrap the call in ``track(replica)``."""

    def __init__(self) -> None:
        self._in_flight: dict[str, int] = defaultdict(int)

    @abstractmethod
    def choose(self, replicas: Sequence[str], blocks: Sequence[int]) -> str:
        """One of ``replicas`` (non-empty) for a prompt with prefix block keys ``blocks``."""

    def load(self, replica: str) -> int:
        return self._in_flight[replica]

    def index_blocks(self) -> int:
        """Prefix block keys the router remembers over all replicas (bounded; 0 if none)."""
        return 0

    def begin(self, replica: str) -> None:
        """A request to ``replica`` starts; pair with ``end``."""
        self._in_flight[replica] += 1

    def end(self, replica: str) -> None:
        self._in_flight[replica] -= 1

    @contextmanager
    def track(self, replica: str) -> Iterator[None]:
        """Counts the request as in flight on ``replica`` while the block runs."""
        self.begin(replica)
        try:
            yield
        finally:
            self.end(replica)


# policy name -> router(index_blocks): ``index_blocks`` bounds a prefix index per replica
ROUTERS: Registry[Callable[[int], LLMRouter]] = Registry("llm routing policy")


class RoundRobinRouter(LLMRouter):
    """Each replica in turn, ignoring prompts and load: the baseline."""

    def __init__(self) -> None:
        super().__init__()
        self._counter = itertools.count()

    def choose(self, replicas: Sequence[str], blocks: Sequence[int]) -> str:
        if not replicas:
            raise ValueError("no replicas")
        return replicas[next(self._counter) % len(replicas)]


ROUTERS.add("round_robin", lambda index_blocks: RoundRobinRouter())


class CacheAwareRouter(LLMRouter):
    """Longest cached prefix wins; load breaks the tie and overrides an overloaded winner.

    The winner is overloaded when its in-flight count is both more than ``load_factor`` times
    and more than ``load_slack`` above the least-loaded replica's."""

    def __init__(
        self, capacity_blocks: int = 65536, load_factor: float = 2.0, load_slack: int = 4
    ) -> None:
        super().__init__()
        self.capacity_blocks = capacity_blocks
        self.load_factor = load_factor
        self.load_slack = load_slack
        self._index: dict[str, OrderedDict[int, None]] = defaultdict(OrderedDict)
        self._rr = itertools.count()

    def match_len(self, replica: str, blocks: Sequence[int]) -> int:
        """How many leading blocks of the prompt the replica has (probably) cached."""
        return leading_held(self._index.get(replica), blocks)

    def index_blocks(self) -> int:
        return sum(len(v) for v in self._index.values())

    def record(self, replica: str, blocks: Sequence[int]) -> None:
        index = self._index[replica]
        for b in blocks:
            index[b] = None
            index.move_to_end(b)
        while len(index) > self.capacity_blocks:
            index.popitem(last=False)

    def overloaded(self, load: int, min_load: int) -> bool:
        return load > self.load_factor * min_load and load > min_load + self.load_slack

    def choose(self, replicas: Sequence[str], blocks: Sequence[int]) -> str:
        if not replicas:
            raise ValueError("no replicas")
        min_load = min(self.load(r) for r in replicas)
        # rotate the scan start so ties spread instead of piling onto replicas[0]
        start = next(self._rr) % len(replicas)
        order = list(replicas[start:]) + list(replicas[:start])
        best = max(order, key=lambda r: (self.match_len(r, blocks), -self.load(r)))
        if self.match_len(best, blocks) == 0 or self.overloaded(self.load(best), min_load):
            best = min(order, key=self.load)
        self.record(best, blocks)
        return best


ROUTERS.add("cache_aware", lambda index_blocks: CacheAwareRouter(capacity_blocks=index_blocks))


class EventRouter(CacheAwareRouter):
    """``CacheAwareRouter`` whose match is what the replica reports it holds (``held(replica,
    blocks)``: leading blocks, or None when its reports are not live: no Redis, a replica that
    publishes none, a stale one), or, where longer, what this gateway sent it in the last
    ``recent_s`` seconds (its events may not be in yet). A replica without live reports is
    matched on this gateway's own record alone, as ``CacheAwareRouter``."""

    def __init__(self, held: Callable[[str, Sequence[int]], int | None], recent_s: float = 5.0,
                 capacity_blocks: int = 65536, load_factor: float = 2.0, load_slack: int = 4) -> None:
        super().__init__(capacity_blocks, load_factor, load_slack)
        self.held = held
        self.recent_s = recent_s
        self._sent: dict[str, dict[int, float]] = defaultdict(dict)  # replica -> block -> when sent

    def match_len(self, replica: str, blocks: Sequence[int]) -> int:
        held = self.held(replica, blocks)
        if held is None:
            return super().match_len(replica, blocks)
        if self.recent_s <= 0:
            return held
        sent, horizon = self._sent.get(replica, {}), time.monotonic() - self.recent_s
        n = 0
        for b in blocks:
            if sent.get(b, horizon) <= horizon:
                break
            n += 1
        return max(held, n)

    def record(self, replica: str, blocks: Sequence[int]) -> None:
        super().record(replica, blocks)
        if self.recent_s <= 0:
            return
        now = time.monotonic()
        sent = self._sent[replica]
        for b in blocks:
            sent.pop(b, None)
            sent[b] = now  # insertion order is age order: the oldest first
        horizon = now - self.recent_s
        while sent:
            b = next(iter(sent))
            if sent[b] > horizon and len(sent) <= self.capacity_blocks:
                break
            del sent[b]


def make_router(policy: str, index_blocks: int = 65536) -> LLMRouter:
    """The ``policy`` router; ``index_blocks`` bounds a cache-aware router's index per replica."""
    return ROUTERS.get(policy)(index_blocks)
