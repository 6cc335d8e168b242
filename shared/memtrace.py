"""Opt-in tracemalloc reports: where a long-running process's Python memory grows.

``MMSERVE_TRACEMALLOC=1`` in a service's environment (the soak's ``--tracemalloc`` sets it for
every process of the stack) starts a daemon thread that traces with ``tracemalloc`` and,
every ``MMSERVE_TRACEMALLOC_INTERVAL`` seconds (60; tracing starts one interval after the
process, past start-up), takes a snapshot and appends to
``$MMSERVE_TRACEMALLOC_DIR/<name>-<pid>.txt`` (the system temp dir if unset) the allocation
sites that grew most since the previous snapshot and since the first one, and the object types
whose live count grew most (``gc``). A diagnosis aid, not for production: tracing every
allocation costs a service a good part of its speed.

What it cannot see: native memory (tokenizers' Rust caches, torch's CPU allocator, malloc's
own fragmentation); for those compare RSS with the glibc heap gauges (``shared.malloc_tuning``).
"""

from __future__ import annotations

import gc
import logging
import os
import tempfile
import threading
import time
import tracemalloc
from collections import Counter
from pathlib import Path

log = logging.getLogger(__name__)

ENV_ON = "MMSERVE_TRACEMALLOC"
ENV_DIR = "MMSERVE_TRACEMALLOC_DIR"
ENV_INTERVAL = "MMSERVE_TRACEMALLOC_INTERVAL"
ENV_FRAMES = "MMSERVE_TRACEMALLOC_FRAMES"
TOP = 15


def enabled(environ=os.environ) -> bool:
    return environ.get(ENV_ON, "").strip().lower() in ("1", "true", "yes", "on")


def type_counts() -> Counter:
    """Live objects tracked by ``gc``, by type name."""
    return Counter(type(o).__name__ for o in gc.get_objects())


def growth_report(before: tracemalloc.Snapshot, after: tracemalloc.Snapshot, top: int = TOP) -> list[str]:
    """The ``top`` allocation sites by bytes grown from ``before`` to ``after`` (growth only)."""
    filters = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, __file__, all_frames=True)]
    stats = after.filter_traces(filters).compare_to(before.filter_traces(filters), "traceback")
    lines = []
    for s in [s for s in stats if s.size_diff > 0][:top]:
        where = " <- ".join(f"{f.filename}:{f.lineno}" for f in reversed(s.traceback))  # innermost first
        lines.append(f"{s.size_diff / 1024:+10.1f} KiB {s.count_diff:+7d} blocks  (now {s.size / 1024:.1f} KiB)  {where}")
    return lines


class MemTrace:
    """The snapshots and their report file (``tick()`` once per interval; see module doc)."""

    def __init__(self, name: str, out_dir: Path, frames: int = 4):
        if not tracemalloc.is_tracing():
            tracemalloc.start(frames)
        self.path = Path(out_dir) / f"{name}-{os.getpid()}.txt"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.first = self.prev = tracemalloc.take_snapshot()
        self.first_types = self.prev_types = type_counts()
        self.started = time.monotonic()

    def tick(self) -> None:
        snap, types = tracemalloc.take_snapshot(), type_counts()
        traced, peak = tracemalloc.get_traced_memory()
        grown = [(k, n - self.prev_types.get(k, 0)) for k, n in types.items()]
        grown = sorted((kv for kv in grown if kv[1] > 0), key=lambda kv: -kv[1])[:TOP]
        out = [f"== t={time.monotonic() - self.started:.0f}s traced={traced / 2**20:.2f} MiB "
               f"peak={peak / 2**20:.2f} MiB objects={sum(types.values())}",
               "-- since the previous snapshot", *growth_report(self.prev, snap),
               "-- since the first snapshot", *growth_report(self.first, snap),
               "-- object types grown since the previous snapshot: "
               + ", ".join(f"{k} {n:+d}" for k, n in grown), ""]
        with self.path.open("a") as f:
            f.write("\n".join(out) + "\n")
        self.prev, self.prev_types = snap, types


_started: MemTrace | bool | None = None


def maybe_start(name: str, environ=os.environ) -> None:
    """With ``MMSERVE_TRACEMALLOC=1``: start the reporting thread (once per process), which starts
    tracing one interval later and reports every interval after; else nothing."""
    global _started
    if not enabled(environ) or _started is not None:
        return
    out_dir = Path(environ.get(ENV_DIR) or tempfile.gettempdir())
    interval = float(environ.get(ENV_INTERVAL) or 60)
    frames = int(environ.get(ENV_FRAMES) or 4)

    def loop() -> None:
        global _started
        # tracing starts one interval in: a model loading under tracemalloc takes minutes, and
        # what start-up allocates is not growth
        time.sleep(interval)
        trace = _started = MemTrace(name, out_dir, frames)
        log.warning("tracemalloc on (%s): reports every %g s to %s", ENV_ON, interval, trace.path)
        while True:
            time.sleep(interval)
            try:
                trace.tick()
            except Exception:  # a report that fails must not end the service
                log.exception("tracemalloc report failed")

    _started = True  # type: ignore[assignment]  # once per process; the MemTrace replaces it
    threading.Thread(target=loop, name="mmserve-memtrace", daemon=True).start()
    return None
