"""Supervision of the local stack's processes (``mmserve up``): a service that exits is started
again with the same command and port after a backoff, while the others keep serving (the
gateway fails over meanwhile and its prober takes the service back once it is ready).

Policy (``RestartPolicy``): the backoff starts at ``initial_backoff`` and doubles up to
``max_backoff``; a service that stayed up ``stable_s`` starts over at ``initial_backoff``. A
service that exits more than ``max_restarts`` times within ``window_s`` is given up on: the
supervisor reports it and returns 1 (the caller stops the stack and exits non-zero).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import httpx


class Supervised(Protocol):
    """What the supervisor needs of a service (``mmserve.launcher.Service`` is one)."""

    name: str
    url: str

    def start(self) -> None: ...
    def alive(self) -> bool: ...
    def exit_code(self) -> int | None: ...
    def log_tail(self, n: int = 4000) -> str: ...


@dataclass(frozen=True)
class RestartPolicy:
    initial_backoff: float = 0.5
    max_backoff: float = 30.0
    max_restarts: int = 5
    window_s: float = 300.0
    stable_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.initial_backoff <= self.max_backoff or self.max_restarts < 0 or self.window_s <= 0:
            raise ValueError(f"invalid restart policy {self}")


@dataclass
class _Tracked:
    svc: Supervised
    started: float
    backoff: float
    exits: deque[float] = field(default_factory=deque)
    restart_at: float | None = None
    awaiting_ready: bool = False

    def on_exit(self, now: float, policy: RestartPolicy) -> float | None:
        """The delay before the restart, or None to give up."""
        if now - self.started >= policy.stable_s:
            self.backoff = policy.initial_backoff
        self.exits.append(now)
        while self.exits and now - self.exits[0] > policy.window_s:
            self.exits.popleft()
        if len(self.exits) > policy.max_restarts:
            return None
        delay, self.backoff = self.backoff, min(2 * self.backoff, policy.max_backoff)
        return delay


def _ready(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(f"{url}/readyz").status_code == 200
    except httpx.HTTPError:
        return False


def supervise(
    services: Sequence[Supervised],
    policy: RestartPolicy = RestartPolicy(),
    *,
    report: Callable[[str], None] = lambda line: print(line, flush=True),
    poll_s: float = 0.5,
    clock: Callable[[], float] = time.monotonic,
    should_stop: Callable[[], bool] = lambda: False,
) -> int:
    """Watch ``services`` (already started) until one is given up on (returns 1) or
    ``should_stop()`` (returns 0); KeyboardInterrupt propagates to the caller."""
    now = clock()
    tracked = [_Tracked(s, now, policy.initial_backoff) for s in services]
    with httpx.Client(timeout=1.0, trust_env=False) as client:
        while not should_stop():
            now = clock()
            for t in tracked:
                name = t.svc.name
                if t.restart_at is not None:
                    if now >= t.restart_at:
                        t.svc.start()
                        t.started, t.restart_at, t.awaiting_ready = now, None, True
                        report(f"mmserve: {name} restarted")
                    continue
                if t.svc.alive():
                    if t.awaiting_ready and _ready(client, t.svc.url):
                        t.awaiting_ready = False
                        report(f"mmserve: {name} is ready again ({t.svc.url})")
                    continue
                code = t.svc.exit_code()
                delay = t.on_exit(now, policy)
                if delay is None:
                    report(f"mmserve: {name} exited with code {code} {len(t.exits)} times within "
                           f"{policy.window_s:g} s; giving up and stopping the stack. Log:\n{t.svc.log_tail()}")
                    return 1
                report(f"mmserve: {name} exited with code {code}; restarting it in {delay:g} s "
                       f"(the rest keeps serving). Log tail:\n{t.svc.log_tail(1500)}")
                t.restart_at = now + delay
            time.sleep(poll_s)
    return 0
