"""The start-up heap out of the garbage collector's way.

A service that has imported torch, transformers and FastAPI and loaded its model holds ~400K
Python objects that live as long as the process. Each full (generation 2) collection walks all
of them: ~300 ms on this 2-core machine, during which the event loop answers nothing (an LLM
front's ``/healthz`` took 261 ms in a quiet ``security_load`` run; every stream's next token
waits the same). ``freeze_startup_heap`` collects once and moves what is alive to the permanent
generation (``gc.freeze``), so later collections walk only what requests created: the same full
collection then takes well under a millisecond. vLLM freezes its start-up heap for the same
reason. Objects created later are collected as before; frozen ones are not scanned until
``thaw_heap`` (a service's shutdown: an app built and closed many times in one process, as the
tests do, leaves nothing frozen behind).
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze_startup_heap(what: str) -> int:
    """Collect, then freeze every object alive now; returns how many were frozen (logged)."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    log.info("%s: %d start-up objects frozen out of the garbage collector's scans (%.0f ms)", what, n,
             (time.perf_counter() - t0) * 1000)
    return n


def thaw_heap() -> None:
    """Undo ``freeze_startup_heap`` (at shutdown): frozen objects are scanned again."""
    gc.unfreeze()
