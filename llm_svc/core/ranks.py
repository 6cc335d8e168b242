"""The engine core's rank group: rank 0 (the core itself: scheduler, prefix tree, tiers and its
own share of the model) spawns ranks 1..N-1 as processes of their own
(``python -m llm_svc.core.rank_worker``), watches them, and stops them; as vLLM's
multiprocess executor. A rank that dies takes the core down with it (``EXIT_RANK_DIED``): the
front's supervision then fails the in-flight requests and starts the whole group again. Each
rank dies with rank 0 (``PR_SET_PDEATHSIG``), so a group never outlives its core.

On the CPU each rank is pinned to its own share of the allowed CPUs (as vLLM CPU's
``VLLM_CPU_OMP_THREADS_BIND``): ranks that share cores fight over them at every barrier."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from llm_svc.parallel import ParallelConfig

log = logging.getLogger(__name__)

SETTINGS_ENV = "MMSERVE_LLM_CORE_SETTINGS"  # the service's settings (JSON), for the core and its ranks
EXIT_RANK_DIED = 4
EXIT_LOAD_FAILED = 2  # as the core's own (process.EXIT_LOAD_FAILED)
WATCH_S = 0.2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_cpus(cpus: list[int], world: int, rank: int) -> list[int]:
    """Rank ``rank``'s share of ``cpus``: an even contiguous slice, or all of them when there are
    fewer CPUs than ranks (then they share)."""
    if len(cpus) < world:
        return list(cpus)
    per = len(cpus) // world
    return list(cpus[rank * per:(rank + 1) * per])


def pin(cpus: list[int]) -> None:
    if hasattr(os, "sched_setaffinity") and cpus:
        os.sched_setaffinity(0, cpus)


def rank_device(device: str, rank: int) -> str:
    """A rank's device: ``cuda`` / ``cuda:0`` on rank r is ``cuda:r`` (one GPU per rank); the CPU stays the CPU."""
    if not device.startswith("cuda"):
        return device
    base = int(device.split(":", 1)[1]) if ":" in device else 0
    return f"cuda:{base + rank}"


class RankWorkers:
    """Ranks 1..N-1 of rank 0's group, started by ``start`` and joined on ``port``."""

    def __init__(self, par: ParallelConfig, device: str):
        self.par, self.device = par, device
        self.port = free_port()
        self.cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.procs: list[subprocess.Popen] = []
        self._stopping = False
        self.ready = False  # set by rank 0 once the group serves

    def start(self, pin_self: bool = True, env: dict[str, str] | None = None) -> None:
        """Spawn the other ranks (they load their shares while rank 0 loads its own); then pin
        this process (rank 0) to its CPUs unless ``pin_self`` is False (an engine in a test's process)."""
        world = self.par.world_size
        for r in range(1, world):
            cmd = [sys.executable, "-m", "llm_svc.core.rank_worker", "--rank", str(r), "--world", str(world),
                   "--port", str(self.port), "--parent", str(os.getpid()),
                   "--cpus", ",".join(map(str, rank_cpus(self.cpus, world, r)))]
            self.procs.append(subprocess.Popen(cmd, env=env if env is not None else os.environ.copy()))
        if pin_self:
            pin(rank_cpus(self.cpus, world, 0))
        log.info("rank group of %d started: ranks 1..%d are pids %s", world, world - 1, [p.pid for p in self.procs])

    def watch(self, before_ready: Callable[[int, int], None]) -> None:
        """A daemon thread that ends this process when another rank exits: the group is broken
        and only a restart of all of it (the front's) brings it back. Before ``ready`` is set
        it is a load failure: ``before_ready(rank, code)`` reports it first."""
        def run() -> None:
            while not self._stopping:
                for r, p in enumerate(self.procs, 1):
                    code = p.poll()
                    if code is not None and not self._stopping:
                        log.error("rank %d (pid %d) exited with %s: the engine core's rank group is broken; "
                                  "exiting so the front restarts it", r, p.pid, code)
                        if not self.ready:
                            try:
                                before_ready(r, code)
                            except Exception:  # the report is best effort: the exit is what matters
                                pass
                        for q in self.procs:
                            if q.poll() is None:
                                q.kill()
                        logging.shutdown()
                        os._exit(EXIT_RANK_DIED if self.ready else EXIT_LOAD_FAILED)
                time.sleep(WATCH_S)

        threading.Thread(target=run, name="rank-watch", daemon=True).start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def start_group(settings, par: ParallelConfig, pin_self: bool = True,
                watch: Callable[[int, int], None] | None = None):
    """Spawn ranks 1..N-1 with ``settings`` (they read them from the environment) and join their
    group as rank 0: ``(RankWorkers, RankGroup, rank 0's device)``. ``watch``: end this process
    when a rank exits (``RankWorkers.watch``; the callback reports a death before ready)."""
    from llm_svc.parallel.comm import init_group

    workers = RankWorkers(par, settings.device)
    workers.start(pin_self, {**os.environ, SETTINGS_ENV: settings.model_dump_json()})
    if watch is not None:
        workers.watch(watch)
    device = rank_device(settings.device, 0)
    try:
        group = init_group(0, par.world_size, workers.port, par.backend_for(device), device, shm=par.shared_memory)
    except BaseException:
        for p in workers.procs:
            p.kill()
        raise
    return workers, group, device
