"""Sharing this small machine: the benchmark lock (``flock /tmp/mmserve-bench.lock``, so two
benchmarks never run at once) and a CPU meter that says how many cores each server, the client
and everything else on the machine used during a run."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path

LOCK_PATH = "/tmp/mmserve-bench.lock"


# ---- process bookkeeping -----------------------------------------------------------------------
def group_cpu_s(pid: int) -> float:
    """utime + stime (s) of every process in ``pid``'s session (the service and its children)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            f = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(f[3]) == pid:  # field 6 (session id), after the "(comm)"
            total += (int(f[11]) + int(f[12])) / tick
    return total


def _busy_s() -> float:
    """CPU seconds the whole machine has spent busy (all cores, /proc/stat)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(f) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """Cores used over an interval by each side's process sessions, by this client, and by
    everything else on the machine (``foreign``: other users' work disturbs the numbers)."""

    def __init__(self, sessions: dict[str, list[int]]):
        self.sessions = sessions

    def _snap(self) -> dict[str, float]:
        snap = {k: sum(group_cpu_s(p) for p in pids) for k, pids in self.sessions.items()}
        snap["client"] = sum(os.times()[:2])
        snap["busy"] = _busy_s()
        return snap

    def start(self) -> None:
        self._t0, self._a = time.perf_counter(), self._snap()

    def stop(self) -> dict[str, float]:
        b, dt = self._snap(), time.perf_counter() - self._t0
        out = {k: (b[k] - self._a[k]) / dt for k in b}
        out["foreign"] = out.pop("busy") - sum(v for k, v in out.items() if k != "busy")
        return {k: round(v, 2) for k, v in out.items()}


def idle_cpu(meter: CpuMeter, seconds: float = 3.0) -> dict[str, float]:
    """Cores each side burns while idle (should be ~0, since both stay up during the other's runs)."""
    meter.start()
    time.sleep(seconds)
    return meter.stop()


@contextlib.contextmanager
def bench_lock(timeout_s: float):
    """Hold the shared benchmark lock (wait up to ``timeout_s``; run anyway, flagged, if it stays taken)."""
    fd = os.open(LOCK_PATH, os.O_CREAT | os.O_RDWR, 0o666)
    held, deadline, said = False, time.monotonic() + timeout_s, False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = True
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                print(f"WARNING: {LOCK_PATH} still taken after {timeout_s:.0f}s; running anyway", flush=True)
                break
            if not said:
                print(f"waiting for {LOCK_PATH} (another benchmark runs) ...", flush=True)
                said = True
            time.sleep(2.0)
    try:
        yield held
    finally:
        if held:
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def wait_quiet(meter: CpuMeter, max_foreign: float, timeout_s: float, probe_s: float = 2.0) -> float:
    """Wait until everything else on the machine uses at most ``max_foreign`` cores (probed over
    ``probe_s``), or ``timeout_s`` passed; returns the last probe's foreign cores. A test suite
    that starts mid-run still disturbs it: ``CpuMeter`` reports that per run."""
    deadline = time.monotonic() + timeout_s
    while True:
        meter.start()
        time.sleep(probe_s)
        foreign = meter.stop()["foreign"]
        if foreign <= max_foreign or time.monotonic() > deadline:
            return foreign
