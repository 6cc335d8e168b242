"""The restart policy and loop of ``mmserve up`` with fake services on a fake clock."""

from __future__ import annotations

import pytest

from mmserve.supervisor import RestartPolicy, supervise

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 0.25  # every look at the clock is a quarter second later
        return self.t


class FakeService:
    """Dies ``lives`` times, each life lasting ``life`` clock seconds after its start."""

    def __init__(self, name: str, clock: Clock, deaths: int, life: float = 1.0) -> None:
        self.name, self.url = name, "http://127.0.0.1:9"  # nothing listens: never "ready"
        self.clock, self.deaths, self.life = clock, deaths, life
        self.started_at = 0.0
        self.starts: list[float] = []

    def start(self) -> None:
        self.started_at = self.clock.t
        self.starts.append(self.clock.t)

    def alive(self) -> bool:
        if self.deaths > 0 and self.clock.t - self.started_at >= self.life:
            return False
        return True

    def exit_code(self) -> int | None:
        return None if self.alive() else -9

    def log_tail(self, n: int = 4000) -> str:
        return f"{self.name} log"

    def died(self) -> None:
        self.deaths -= 1


def run(services, policy, clock, until: float) -> tuple[int, list[str]]:
    lines: list[str] = []

    def report(line: str) -> None:
        lines.append(line)
        if "restarted" in line:
            for s in services:
                if line.startswith(f"mmserve: {s.name} "):
                    s.died()

    code = supervise(services, policy, report=report, poll_s=0, clock=clock, should_stop=lambda: clock.t > until)
    return code, lines


def test_a_crashed_service_is_restarted_with_doubling_backoff_and_the_rest_untouched():
    clock = Clock()
    flaky, steady = FakeService("encoder-1", clock, deaths=3), FakeService("llm-0", clock, deaths=0)
    policy = RestartPolicy(initial_backoff=1.0, max_backoff=4.0, max_restarts=5, stable_s=1000)
    code, lines = run([flaky, steady], policy, clock, until=60)
    assert code == 0
    assert steady.starts == []  # never touched
    assert len(flaky.starts) == 3
    gaps = [b - a for a, b in zip(flaky.starts, flaky.starts[1:])]
    assert gaps[0] < gaps[1]  # 1 s, then 2 s of backoff after each one-second life
    exits = [line for line in lines if "exited with code -9" in line]
    assert [line.split("restarting it in ")[1].split(" s")[0] for line in exits] == ["1", "2", "4"]


def test_a_service_that_keeps_crashing_is_given_up_with_exit_code_1():
    clock = Clock()
    doomed = FakeService("encoder-0", clock, deaths=100)
    policy = RestartPolicy(initial_backoff=0.5, max_backoff=0.5, max_restarts=3, window_s=100)
    code, lines = run([doomed], policy, clock, until=1000)
    assert code == 1
    assert len(doomed.starts) == 3
    assert "giving up" in lines[-1] and "encoder-0 log" in lines[-1]


def test_backoff_starts_over_after_a_stable_run():
    clock = Clock()
    svc = FakeService("gateway", clock, deaths=3, life=10.0)
    policy = RestartPolicy(initial_backoff=1.0, max_backoff=8.0, max_restarts=10, stable_s=5.0)
    code, lines = run([svc], policy, clock, until=100)
    delays = [line.split("restarting it in ")[1].split(" s")[0] for line in lines if "restarting" in line]
    assert code == 0 and delays == ["1", "1", "1"]


def test_policy_invariants():
    with pytest.raises(ValueError):
        RestartPolicy(initial_backoff=0)
    with pytest.raises(ValueError):
        RestartPolicy(initial_backoff=10, max_backoff=1)
