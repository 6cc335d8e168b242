"""Sharing this small machine: the benchmark lock (``flock /tmp/mmserve-bench.lock``, so two
benchmarks never run at once), a CPU meter that says how many cores each server's process tree,
the client and everything else on the machine used during a run, and a record of what each
server's processes actually ran with (CPU affinity of every thread, OpenMP / preload env)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections import Counter
from pathlib import Path

LOCK_PATH = "/tmp/mmserve-bench.lock"
_TICK = os.sysconf("SC_CLK_TCK")


# ---- process bookkeeping -----------------------------------------------------------------------
def proc_table() -> dict[int, tuple[int, float]]:
    """pid -> (ppid, CPU seconds) of every process now: utime + stime, plus cutime + cstime (the
    CPU of its children it has already reaped, so a short-lived helper's CPU is not lost)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            f = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # after "(comm)": f[0] state, f[1] ppid, ..., f[11..14] utime stime cutime cstime
        out[int(d.name)] = (int(f[1]), sum(int(x) for x in f[11:15]) / _TICK)
    return out


def tree_pids(table: dict[int, tuple[int, float]], roots: list[int]) -> set[int]:
    """``roots`` and all their live descendants (by ppid), whatever session or group they are in
    (our engine core runs in its own session; vLLM's engine core and worker are children)."""
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        kids.setdefault(ppid, []).append(pid)
    seen, todo = set(), [p for p in roots if p in table]
    while todo:
        p = todo.pop()
        if p not in seen:
            seen.add(p)
            todo.extend(kids.get(p, ()))
    return seen


def _busy_s() -> float:
    """CPU seconds the whole machine has spent busy (all cores, /proc/stat)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(f) - f[3] - f[4]) / _TICK


class CpuMeter:
    """Cores used over an interval by each side's process trees (found anew at every sample from
    /proc/*/stat ppid links), by this client process, and by everything else on the machine
    (``foreign`` = machine busy - sides - client: other users' work disturbs the numbers)."""

    def __init__(self, roots: dict[str, list[int]]):
        self.roots = roots

    def _snap(self) -> dict[str, float]:
        table = proc_table()
        me = os.getpid()
        snap = {}
        for k, pids in self.roots.items():
            snap[k] = sum(table[p][1] for p in tree_pids(table, pids) if p != me)
        t = os.times()
        snap["client"] = t[0] + t[1]  # this process alone (its children are the servers)
        snap["busy"] = _busy_s()
        return snap

    def start(self) -> None:
        self._t0, self._a = time.perf_counter(), self._snap()

    def stop(self) -> dict[str, float]:
        b, dt = self._snap(), time.perf_counter() - self._t0
        out = {k: (b[k] - self._a[k]) / dt for k in b}
        busy = out.pop("busy")
        out["foreign"] = busy - sum(out.values())
        return {k: round(v, 2) for k, v in out.items()}


_ENV_KEYS = ("OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND", "OMP_WAIT_POLICY", "GOMP_CPU_AFFINITY",
             "GOMP_SPINCOUNT", "KMP_AFFINITY", "KMP_BLOCKTIME", "LD_PRELOAD", "MKL_NUM_THREADS", "MMSERVE_LLM_THREADS",
             "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_KVCACHE_SPACE")  # fmt: skip


def _status(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        k, _, v = line.partition(":")
        out[k] = v.strip()
    return out


def process_report(root: int) -> list[dict]:
    """What every process of ``root``'s tree runs with: its command, CPU affinity
    (``Cpus_allowed_list`` of the process and, per distinct value, how many of its threads have
    it: OpenMP binding pins threads, not processes), thread count, and the OpenMP / preload
    variables of its environment as exec'd (``/proc/PID/environ``; a forked child shows its
    parent's start-up env, its threads' affinity is the ground truth)."""
    table = proc_table()
    rows = []
    for pid in sorted(tree_pids(table, [root])):
        d = Path(f"/proc/{pid}")
        try:
            st = _status(d / "status")
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            env = dict(kv.split("=", 1) for kv in (d / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in kv)  # fmt: skip
            tasks = Counter()
            for t in (d / "task").iterdir():
                with contextlib.suppress(OSError):
                    tasks[_status(t / "status").get("Cpus_allowed_list", "?")] += 1
        except OSError:
            continue
        rows.append({
            "pid": pid, "ppid": table.get(pid, (None,))[0], "name": st.get("Name"), "cmd": cmd[:160],
            "cpus_allowed": st.get("Cpus_allowed_list"), "threads": int(st.get("Threads", 0)),
            "thread_affinity": dict(tasks), "env": {k: env[k] for k in _ENV_KEYS if k in env},
        })  # fmt: skip
    return rows


def idle_cpu(meter: CpuMeter, seconds: float = 3.0) -> dict[str, float]:
    """Cores each side burns while idle (should be ~0, since both stay up during the other's runs)."""
    meter.start()
    time.sleep(seconds)
    return meter.stop()


HELD_ENV = "MMSERVE_BENCH_LOCK_HELD"  # set while held: a benchmark run by the holder does not wait on it


@contextlib.contextmanager
def bench_lock(timeout_s: float):
    """Hold the shared benchmark lock (wait up to ``timeout_s``; run anyway, flagged, if it stays
    taken). Re-entrant down the process tree: while held, ``$MMSERVE_BENCH_LOCK_HELD`` is set, and
    a holder's child (a benchmark the CI smoke step runs, a benchmark's worker) takes it as held."""
    if os.environ.get(HELD_ENV) == "1":
        yield True
        return
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
    if held:
        os.environ[HELD_ENV] = "1"
    try:
        yield held
    finally:
        if held:
            os.environ.pop(HELD_ENV, None)
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
