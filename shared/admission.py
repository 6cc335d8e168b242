"""Admission control shared by the services: at most ``max_in_flight`` requests served at once
and at most ``max_queue`` waiting (FIFO, each for at most ``queue_timeout`` s); anything past
that is refused at once with ``Overloaded`` -> HTTP 429 with ``Retry-After`` (OpenAI's
``rate_limit_error``).  Refusing early keeps the latency of admitted requests bounded and the
memory flat instead of letting a backlog grow without end.

Deadlines travel between services as the time left (``DEADLINE_HEADER``, milliseconds): a
relative budget is immune to clock skew between hosts; each hop turns it into a monotonic
deadline on arrival.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

DEADLINE_HEADER = "x-mmserve-deadline-ms"


class Overloaded(Exception):
    """Refused by admission control; ``retry_after`` in whole seconds for the client."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


@dataclass(frozen=True)
class AdmissionConfig:
    max_in_flight: int
    max_queue: int = 0
    queue_timeout: float = 10.0

    def __post_init__(self) -> None:
        if self.max_in_flight < 1 or self.max_queue < 0 or self.queue_timeout <= 0:
            raise ValueError(f"invalid admission config {self}")


class Ticket:
    """One admitted request; ``release()`` is idempotent (a stream may end twice)."""

    __slots__ = ("_gate", "_done")

    def __init__(self, gate: "Admission") -> None:
        self._gate = gate
        self._done = False

    def release(self) -> None:
        if not self._done:
            self._done = True
            self._gate._release()


class Admission:
    """The gate of one service (one event loop). Counters are read by the metrics."""

    def __init__(self, cfg: AdmissionConfig, service: str) -> None:
        self.cfg = cfg
        self.service = service
        self.in_flight = 0
        self._waiters: deque[asyncio.Future] = deque()
        self.admitted = 0
        self.rejected = 0

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def _refuse(self, why: str) -> Overloaded:
        self.rejected += 1
        return Overloaded(
            f"the {self.service} is overloaded ({why}); retry after the Retry-After seconds",
            retry_after=max(1, math.ceil(self.queued / self.cfg.max_in_flight)),
        )

    def shed(self) -> Overloaded | None:
        """``Overloaded`` (counted as a rejection) when ``acquire`` would refuse at once: every
        slot taken and the queue full. Lets a service answer the 429 before it reads or parses
        the request (under 4x overload most requests are refused; each should cost little)."""
        if self.in_flight >= self.cfg.max_in_flight and len(self._waiters) >= self.cfg.max_queue:
            return self._refuse(f"{self.in_flight} requests in flight, {self.queued} queued")
        return None

    async def acquire(self) -> Ticket:
        """A ticket now, after a wait in the queue, or ``Overloaded``."""
        if self.in_flight < self.cfg.max_in_flight and not self._waiters:
            self.in_flight += 1
            self.admitted += 1
            return Ticket(self)
        if len(self._waiters) >= self.cfg.max_queue:
            raise self._refuse(f"{self.in_flight} requests in flight, {self.queued} queued")
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.cfg.queue_timeout)
        except asyncio.TimeoutError:
            if fut.done() and not fut.cancelled():  # granted in the same instant: hand it on
                self._release()
            raise self._refuse(f"queued over {self.cfg.queue_timeout:g} s") from None
        except BaseException:
            if fut.done() and not fut.cancelled():
                self._release()
            raise
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)
        self.admitted += 1
        return Ticket(self)  # the slot was handed over by _release: in_flight already counts it

    def _release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot passes to the oldest waiter
                return
        self.in_flight -= 1
        assert self.in_flight >= 0, self.in_flight

    def check_integrity(self) -> None:
        assert 0 <= self.in_flight <= self.cfg.max_in_flight, self.in_flight
        assert len(self._waiters) <= self.cfg.max_queue, len(self._waiters)
        assert not self._waiters or self.in_flight == self.cfg.max_in_flight, "waiting while a slot is free"


def deadline_from(headers: Mapping[str, str], default_s: float | None = None) -> float | None:
    """The monotonic deadline a request's ``DEADLINE_HEADER`` sets (else ``default_s`` from now)."""
    raw = headers.get(DEADLINE_HEADER)
    now = time.monotonic()
    if raw is not None:
        try:
            return now + max(0.0, float(raw)) / 1000.0
        except ValueError:
            pass
    return None if default_s is None else now + default_s


def deadline_header(deadline: float | None) -> dict[str, str]:
    """The header that carries what is left of ``deadline`` to the next hop."""
    if deadline is None:
        return {}
    return {DEADLINE_HEADER: str(max(0, int((deadline - time.monotonic()) * 1000)))}
