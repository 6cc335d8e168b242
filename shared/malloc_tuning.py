"""glibc malloc tuning for long-running asyncio services, and its numbers for metrics.

Why: asyncio's socket transports read with ``recv(256 KiB)``: Python allocates a 256 KiB bytes
object, then shrinks it to what arrived. glibc serves allocations past its mmap threshold
(128 KiB) with ``mmap``, but the first time such a block is freed it raises the threshold to
that size ("dynamic threshold"), so every later read buffer is carved out of the heap instead
and shrunk in place. The short-lived pieces and the longer-lived ones interleave, the holes
between them are too small for the next 256 KiB read, and the heap grows by the free space it
cannot reuse: a torch-free gateway's RSS rose ~400 B per request in a soak with the memory in use
flat (mallinfo2: in use 15.7 MB throughout, free in the heap 0.7 -> 3.0 MB over 7,000
requests). Fixing the threshold (``mallopt(M_MMAP_THRESHOLD)``, which also turns the dynamic
adjustment off) keeps those buffers in their own mappings, returned whole when freed.

Not for processes that allocate large tensors at a high rate (the LLM engine core, the
encoders): there every tensor past the threshold would be a fresh ``mmap`` and page faults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
DEFAULT_MMAP_THRESHOLD = 128 * 1024  # glibc's own starting value


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, loaded once: a ``CDLL`` per call (three per /metrics scrape) built a new
    ctypes function-pointer class each time, garbage that only the cyclic collector frees."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "mallopt"):  # musl and other non-glibc C libraries
        return None
    return libc


def pin_mmap_threshold(nbytes: int = DEFAULT_MMAP_THRESHOLD) -> bool:
    """Fixes glibc's mmap threshold at ``nbytes`` for this process (0 leaves glibc's dynamic
    default). Returns whether it was applied (False off glibc, or when ``nbytes`` is 0)."""
    if nbytes <= 0:
        return False
    libc = _libc()
    if libc is None:
        log.info("not glibc: malloc mmap threshold left as is")
        return False
    ok = bool(libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(nbytes)))
    if not ok:
        log.warning("mallopt(M_MMAP_THRESHOLD, %d) was refused; malloc left as is", nbytes)
    return ok


def malloc_heap() -> tuple[int, int, int] | None:
    """``(heap, in_use, free)`` bytes of glibc's arenas (``mallinfo2``; mmapped blocks are not
    heap), or None off glibc. ``free`` is heap memory the allocator holds but cannot hand back:
    fragmentation when it grows while ``in_use`` does not."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    if libc.mallinfo2.restype is not _MallInfo2:
        libc.mallinfo2.restype = _MallInfo2
    m = libc.mallinfo2()
    return int(m.arena), int(m.uordblks), int(m.fordblks)


def heap_gauge(name: str, registry) -> None:
    """Registers ``name{kind=heap|in_use|free}`` in a Prometheus ``registry``, read at scrape
    time (0 off glibc)."""
    from prometheus_client import Gauge

    g = Gauge(name, "glibc heap of this process: heap (obtained from the OS), in_use, free (held, not "
              "reusable: fragmentation when it grows and in_use does not)", ["kind"], registry=registry)
    for i, kind in enumerate(("heap", "in_use", "free")):
        g.labels(kind).set_function(lambda i=i: (malloc_heap() or (0, 0, 0))[i])
