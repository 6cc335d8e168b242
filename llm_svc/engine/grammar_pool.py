"""Grammar compiles in worker processes that can be killed (``llm_svc.engine.grammar_worker``).

An xgrammar compile cannot be interrupted, and a hostile schema compiles for minutes, so a
compile runs in a process of its own and this pool enforces two things a thread pool could not:

* a **time limit**: a compile that has used more than ``timeout_s`` seconds of CPU is killed and
  its job fails with ``CompileTimeout``. CPU time rather than wall time because the workers run
  at the lowest priority: on a busy machine a normal compile may wait long for a core, which is
  not its fault; a wall-clock backstop (``wall_factor`` times the limit) still ends a worker that
  never gets one (a stopped process);
* a **CPU share**: past its first ``full_speed_s`` CPU seconds (a normal compile is done by then)
  a compile runs ``slow_share`` of each ``DUTY_PERIOD_S`` and is stopped (``SIGSTOP``) for the
  rest. The lowest priority alone does not keep a long compile harmless: on these VMs a process
  burning "idle" cores at ``SCHED_IDLE`` still slowed the steady streams' p99 ITL 1.3-1.5x (the
  host does not know the guest's priorities), so a compile that looks hostile gets a fraction of
  a core until its time limit ends it;
* **cancellation**: a queued job nobody waits for is dropped; a running one is killed after
  ``grace_s`` (it may be about to finish: its result is then kept by the caller's cache).

Up to ``workers`` processes run at once, started as jobs queue (each one imports xgrammar:
about 3 s of CPU and 300 MiB of its own), so a hostile compile holds one worker while the others
serve the rest; a killed worker is reaped and replaced, one stays warm once the pool has been
used, and the others exit after ``IDLE_RETIRE_S`` without work. One
thread (``grammar-pool``) starts, feeds and watches the workers, and reports each job's end
through its ``on_done``; it is started by the first ``submit``, so an engine that never sees a
constrained request starts no process.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .grammar_errors import CompilerUnavailable, CompileTimeout, GrammarError
from .grammar_frames import read_frame, write_frame

log = logging.getLogger(__name__)

_TICK = 0.1  # seconds between limit checks while a compile runs
DUTY_PERIOD_S = 0.1  # a throttled compile runs slow_share of each such period
# a worker holds about 300 MiB of its own (xgrammar imports torch): beyond the one kept warm,
# workers idle this long exit
IDLE_RETIRE_S = 60.0
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(eq=False)
class Job:
    """One compile: ``payload`` is ``[kind, spec, any_whitespace]``; ``on_done(job, result,
    error)`` is called once, on the pool's thread, with the serialized ``CompiledGrammar`` or
    the error (never for a job cancelled in time)."""

    payload: list
    on_done: Callable[["Job", str | None, BaseException | None], None]
    key: str = ""  # the caller's name for it
    timeout_message: str = "the grammar did not compile in time"
    cancelled: bool = False
    abandon_at: float | None = None  # cancelled while running: killed at this time


@dataclass(eq=False)
class _Worker:
    proc: subprocess.Popen
    ready: bool = False
    job: Job | None = None
    started: float = 0.0  # the job's start, wall clock
    idle_since: float = field(default_factory=time.monotonic)
    cpu0: float = 0.0  # the worker's CPU seconds when the job started
    throttled: bool = False  # its job passed full_speed_s: it runs slow_share of each period
    paused: bool = False  # stopped (SIGSTOP) until switch_at
    switch_at: float = 0.0


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (Linux ``/proc``), or None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            rest = f.read().rsplit(b")", 1)[1].split()
        return (int(rest[11]) + int(rest[12])) / _CLK_TCK  # utime, stime (fields 14 and 15)
    except (OSError, IndexError, ValueError):
        return None


def _signal(proc: subprocess.Popen, sig: int) -> bool:
    """Send ``sig`` to a live ``proc``; False when it has already exited."""
    if proc.poll() is not None:
        return False
    try:
        proc.send_signal(sig)
        return True
    except ProcessLookupError:
        return False


def _worker_env() -> dict[str, str]:
    """The worker imports ``llm_svc`` from where this process did, installed or not."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root if not path else f"{root}{os.pathsep}{path}"}


class CompilePool:
    """``submit`` a compile, ``cancel`` it, ``close`` the pool. ``init`` builds the workers'
    first frame (the tokenizer's token table, serialized); it is called once, on the pool's
    thread, before the first worker starts."""

    def __init__(self, init: Callable[[], str], workers: int = 2, threads: int = 1, timeout_s: float = 10.0,
                 grace_s: float = 0.5, wall_factor: float = 10.0, full_speed_s: float = 1.0,
                 slow_share: float = 1.0) -> None:
        if not 0.0 < slow_share <= 1.0:
            raise ValueError(f"slow_share must be in (0, 1], got {slow_share}")
        self._init, self._init_frame = init, None
        self.max_workers, self.threads, self.timeout_s = max(1, workers), threads, timeout_s
        self.full_speed_s, self.slow_share = full_speed_s, slow_share
        # the wall time a compile needs to reach its CPU limit at its share, times the factor
        needed = min(timeout_s, full_speed_s) + max(0.0, timeout_s - full_speed_s) / slow_share
        self.grace_s, self.wall_limit = grace_s, max(60.0, wall_factor * needed)
        self._queue: collections.deque[Job] = collections.deque()
        self._workers: list[_Worker] = []  # the pool thread's alone
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._warm = False  # a worker started fine: keep one ready from now on
        self._last_failed_start = 0.0
        self.counts = collections.Counter()  # timeouts, kills (abandoned), starts, crashes

    # ------------------------------------------------------------------ callers' side (any thread)
    def submit(self, payload: list, on_done, key: str = "", timeout_message: str = "") -> Job:
        job = Job(payload, on_done, key, timeout_message or Job.timeout_message)
        with self._lock:
            if self._closed:
                raise CompilerUnavailable("the grammar compiler is shut down")
            self._queue.append(job)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="grammar-pool", daemon=True)
                self._thread.start()
        self._wake()
        return job

    def cancel(self, job: Job) -> None:
        """Nobody waits for ``job`` any more: dropped if queued, killed after ``grace_s`` if running."""
        with self._lock:
            job.cancelled = True
            try:
                self._queue.remove(job)
            except ValueError:
                pass
        self._wake()

    def stats(self) -> dict[str, int]:
        with self._lock:
            queued = len(self._queue)
        workers = list(self._workers)
        return {"grammar_workers": len(workers), "grammar_queued": queued,
                "grammar_running": sum(w.job is not None for w in workers),
                "grammar_timeouts": self.counts["timeouts"], "grammar_abandoned": self.counts["abandoned"],
                "grammar_worker_starts": self.counts["starts"], "grammar_throttled": self.counts["throttled"]}

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in list(self._workers)]

    def close(self) -> None:
        """Kill and reap every worker; queued and running jobs fail with ``CompilerUnavailable``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        self._wake()
        if thread is not None and thread is not threading.current_thread():
            thread.join(10)
        if thread is None or not thread.is_alive():
            with self._lock:
                fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
            for fd in fds:
                os.close(fd)

    def _wake(self) -> None:
        if self._wake_w < 0:  # closed
            return
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # full: a wake is pending anyway
            pass

    # ------------------------------------------------------------------ the pool's thread
    def _run(self) -> None:
        try:
            while not self._step():
                pass
            self._fail_all(CompilerUnavailable("the grammar compiler is shut down"))
        except BaseException as e:  # never leave callers waiting on a dead thread
            log.exception("grammar compile pool failed")
            self._fail_all(CompilerUnavailable(f"the grammar compiler failed ({type(e).__name__}); retry"))
        finally:
            for w in list(self._workers):
                self._kill(w)

    def _step(self) -> bool:
        """One round: start workers, hand out jobs, wait for replies, enforce limits. True: closed."""
        with self._lock:
            if self._closed:
                return True
        self._spawn_needed()
        self._assign()
        busy = [w for w in self._workers if w.job is not None]
        starting = [w for w in self._workers if not w.ready]
        wait = _TICK if busy else (1.0 if starting or self._queue or len(self._workers) > 1 else None)
        switches = [w.switch_at for w in busy if w.throttled]
        if switches:
            wait = max(0.001, min(wait, min(switches) - time.monotonic()))
        poll = select.poll()
        poll.register(self._wake_r, select.POLLIN)
        by_fd = {}
        for w in self._workers:
            fd = w.proc.stdout.fileno()
            by_fd[fd] = w
            poll.register(fd, select.POLLIN)
        for fd, _ in poll.poll(None if wait is None else max(1, int(wait * 1000))):
            if fd == self._wake_r:
                os.read(self._wake_r, 4096)
            else:
                self._reply(by_fd[fd])
        self._enforce()
        self._retire_idle()
        return False

    def _spawn_needed(self) -> None:
        with self._lock:
            queued = len(self._queue)
        idle = sum(w.job is None for w in self._workers)
        want = min(self.max_workers, max(int(self._warm), len(self._workers) + queued - idle))
        if len(self._workers) >= want:
            return
        if time.monotonic() - self._last_failed_start < 1.0:  # a broken environment: no spinning
            return
        if self._init_frame is None:
            try:
                self._init_frame = [self._init(), self.threads]
            except Exception as e:
                log.exception("the grammar compiler could not be set up")
                self._last_failed_start = time.monotonic()
                self._fail_queued(CompilerUnavailable(f"the grammar compiler could not start ({type(e).__name__})"))
                return
        while len(self._workers) < want and time.monotonic() - self._last_failed_start >= 1.0:
            self._start_worker()

    def _start_worker(self) -> None:
        try:
            proc = subprocess.Popen([sys.executable, "-m", "llm_svc.engine.grammar_worker", str(os.getpid())],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_worker_env())
        except OSError as e:  # out of processes or file descriptors
            log.error("a grammar compile worker could not be started: %s", e)
            self._last_failed_start, self._warm = time.monotonic(), False
            self._fail_queued(CompilerUnavailable("the grammar compiler could not start; retry later"))
            return
        w = _Worker(proc)
        self._workers.append(w)
        self.counts["starts"] += 1
        try:
            write_frame(proc.stdin, self._init_frame)
        except OSError:
            self._lost(w)

    def _assign(self) -> None:
        for w in self._workers:
            if not w.ready or w.job is not None:
                continue
            with self._lock:
                if not self._queue:
                    return
                job = self._queue.popleft()
            w.job, w.started = job, time.monotonic()
            w.cpu0 = _cpu_seconds(w.proc.pid) or 0.0
            self._full_speed(w)
            try:
                write_frame(w.proc.stdin, job.payload)
            except OSError:
                self._lost(w)

    def _reply(self, w: _Worker) -> None:
        msg = read_frame(w.proc.stdout)
        if msg is None:
            self._lost(w)
            return
        ok, body = msg
        if not w.ready:
            w.ready = self._warm = True
            return
        job, w.job, w.idle_since = w.job, None, time.monotonic()
        self._full_speed(w)  # it may have been stopped right after it wrote this reply
        if job is None:
            return
        # a cancelled job's result is still reported: the caller's cache keeps it
        job.on_done(job, body, None) if ok else job.on_done(job, None, GrammarError(body))

    def _enforce(self) -> None:
        now = time.monotonic()
        for w in list(self._workers):
            job = w.job
            if job is None:
                continue
            if job.cancelled:
                if job.abandon_at is None:
                    job.abandon_at = now + self.grace_s
                elif now >= job.abandon_at:
                    self.counts["abandoned"] += 1
                    self._kill(w)
                continue
            cpu = _cpu_seconds(w.proc.pid)
            used = (cpu - w.cpu0) if cpu is not None else now - w.started
            if used > self.timeout_s or now - w.started > self.wall_limit:
                self.counts["timeouts"] += 1
                log.warning("a grammar compile passed its limit (%.1f s CPU, %.1f s wall): worker %d killed",
                            used, now - w.started, w.proc.pid)
                self._kill(w)
                job.on_done(job, None, CompileTimeout(job.timeout_message))
            elif self.slow_share < 1.0:
                self._duty_cycle(w, used, now)

    def _duty_cycle(self, w: _Worker, used: float, now: float) -> None:
        """Past ``full_speed_s`` CPU seconds, ``w`` runs ``slow_share`` of each period, stopped for the rest."""
        if not w.throttled:
            if used <= self.full_speed_s:
                return
            w.throttled, w.switch_at = True, now
            self.counts["throttled"] += 1
            log.info("a grammar compile passed %.1f s of CPU: worker %d now runs %.0f%% of a core until its limit",
                     self.full_speed_s, w.proc.pid, self.slow_share * 100)
        if now < w.switch_at:
            return
        pause = not w.paused
        if not _signal(w.proc, signal.SIGSTOP if pause else signal.SIGCONT):
            return  # gone: its reply (or its loss) is read next round
        w.paused = pause
        w.switch_at = now + DUTY_PERIOD_S * ((1.0 - self.slow_share) if pause else self.slow_share)

    def _full_speed(self, w: _Worker) -> None:
        """``w`` runs unthrottled again (its job ended, or a new one starts)."""
        if w.paused:
            _signal(w.proc, signal.SIGCONT)
        w.throttled = w.paused = False

    def _retire_idle(self) -> None:
        """Workers past the warm one that had nothing to do for ``IDLE_RETIRE_S`` exit."""
        now = time.monotonic()
        for w in [w for w in self._workers if w.ready and w.job is None][1:]:
            if now - w.idle_since >= IDLE_RETIRE_S:
                self._kill(w)

    def _lost(self, w: _Worker) -> None:
        """``w`` died on its own (a crash, the OOM killer, a failed start): reaped, its job failed."""
        job = w.job
        self._kill(w)
        code = w.proc.returncode
        if not w.ready:
            log.error("a grammar compile worker exited while starting (status %s)", code)
            self._last_failed_start, self._warm = time.monotonic(), False  # started again for the next job
            self._fail_queued(CompilerUnavailable("the grammar compiler could not start; retry later"))
            return
        self.counts["crashes"] += 1
        log.error("a grammar compile worker died while compiling (status %s)", code)
        if job is not None:
            job.on_done(job, None, GrammarError("the grammar compiler stopped on this spec (it ran out of memory or "
                                                "crashed); simplify it"))

    def _kill(self, w: _Worker) -> None:
        if w in self._workers:
            self._workers.remove(w)
        w.job = None
        if w.proc.poll() is None:
            w.proc.kill()
        w.proc.wait()  # reaped: no zombie
        for f in (w.proc.stdin, w.proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    def _fail_queued(self, err: BaseException) -> None:
        with self._lock:
            jobs, self._queue = list(self._queue), collections.deque()
        for job in jobs:
            job.on_done(job, None, err)

    def _fail_all(self, err: BaseException) -> None:
        running = [w.job for w in self._workers if w.job is not None]
        for w in list(self._workers):
            self._kill(w)
        self._fail_queued(err)
        for job in running:
            job.on_done(job, None, err)
