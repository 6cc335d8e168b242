"""Collectives for CPU ranks on one host through one shared-memory segment (vLLM CPU has the
same idea): an all-reduce and rank 0's broadcast of a step's inputs without a socket, a
wake-up or a copy through the kernel. gloo over TCP cost ~2.4 ms per all-reduce of a few KB
on a busy 2-core machine (each side woken by the other's packet), which is most of a small
model's decode step; here a rank writes its part, bumps its sequence number and waits for the
others' numbers, spinning briefly and then yielding its core.

Layout of the segment: ``world`` sequence counters for the all-reduce and ``world`` for the
broadcast's acknowledgements (one cache line each), then two all-reduce buffers (alternated
call by call, so a fast rank never overwrites what a slow one is still summing) of ``world``
slots of ``slot_bytes`` each, then the broadcast area (its sequence number, its length, its bytes).

Ordering: x86's stores become visible in program order, so a counter read as ``n`` means its
rank's data for call ``n`` is there (this module is used only on x86-64). Every rank sums the
slots in rank order, so every rank gets the same result, bit for bit."""

from __future__ import annotations

import mmap
import os
import pickle
import platform
import time
import uuid

import numpy as np
import torch

LINE = 64  # bytes per counter: one cache line each, no false sharing
SPIN = 2000  # polls before yielding the core
SLEEP_AFTER_S = 0.002  # past this long waiting, sleep between polls (an idle rank between steps)
SLEEP_S = 0.0002


def supported() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm")


class ShmChannel:
    """One rank's view of the group's segment at ``path`` (created by rank 0 with ``create``)."""

    def __init__(self, path: str, rank: int, world: int, slot_bytes: int, obj_bytes: int, create: bool):
        self.rank, self.world = rank, world
        self.slot_bytes, self.obj_bytes = slot_bytes, obj_bytes
        head = 2 * world * LINE + 2 * LINE
        size = head + 2 * world * slot_bytes + obj_bytes
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        raw = torch.frombuffer(self._mm, dtype=torch.uint8)
        # the counters as numpy: a poll is ~0.3 us there, ~5 us as a torch op
        counters = np.frombuffer(self._mm, dtype=np.int64, count=head // 8).reshape(-1, LINE // 8)  # [2 world + 2, 8]
        self._seq = counters[:world, 0]  # all-reduce calls each rank has written
        self._ack = counters[world:2 * world, 0]  # broadcasts each rank has read
        self._obj_seq = counters[2 * world:2 * world + 1, 0]
        self._obj_len = counters[2 * world + 1:2 * world + 2, 0]
        bufs = raw[head:head + 2 * world * slot_bytes].view(torch.float32)
        self._bufs = bufs.view(2, world, slot_bytes // 4)  # [parity, rank, floats]
        self._obj = raw[head + 2 * world * slot_bytes:]
        self._n = 0  # all-reduce calls made
        self._m = 0  # broadcasts made

    def fits(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.numel() * 4 <= self.slot_bytes and t.is_floating_point()

    def all_reduce(self, t: torch.Tensor, timeout_s: float | None = None) -> torch.Tensor:
        """Sum ``t`` (CPU, at most ``slot_bytes`` as float32) over the ranks in place; a
        ``TimeoutError`` when a rank has not arrived within ``timeout_s``."""
        self._n += 1
        n, k = self._n, t.numel()
        bufs = self._bufs[n % 2]
        bufs[self.rank, :k].copy_(t.reshape(-1))
        self._seq[self.rank] = n
        _wait(lambda: bool((self._seq >= n).all()), timeout_s)
        out = t.reshape(-1)
        if t.dtype == torch.float32:
            out.copy_(bufs[0, :k])
            for r in range(1, self.world):
                out.add_(bufs[r, :k])
        else:  # summed in float32, rounded once, as one rank's GEMM would
            acc = bufs[0, :k].clone()
            for r in range(1, self.world):
                acc.add_(bufs[r, :k])
            out.copy_(acc)
        return t

    def broadcast(self, obj=None):
        """Rank 0's ``obj`` on every rank, pickled; falls back to None when it does not fit (the
        caller then uses its other channel)."""
        if self.rank == 0:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            if len(data) > self.obj_bytes:
                raise OverflowError(len(data))  # nothing published: the caller sends it another way
        self._m += 1
        m = self._m
        if self.rank == 0:
            # the area is free once every rank has read the previous one
            _wait(lambda: bool((self._ack[1:] >= m - 1).all()))
            self._obj[:len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            self._obj_len[0] = len(data)
            self._obj_seq[0] = m
            return obj
        _wait(lambda: int(self._obj_seq[0]) >= m)
        n = int(self._obj_len[0])
        out = pickle.loads(self._obj[:n].numpy().tobytes())
        self._ack[self.rank] = m
        return out

    def close(self) -> None:
        for name in ("_seq", "_ack", "_obj_seq", "_obj_len", "_bufs", "_obj"):
            setattr(self, name, None)
        try:
            self._mm.close()
        except BufferError:  # a view still alive somewhere: the mapping goes with the process
            pass


def _wait(ready, timeout_s: float | None = None) -> None:
    """Spin on ``ready()``, then yield the core between polls, then sleep between them."""
    for _ in range(SPIN):
        if ready():
            return
    t0 = time.monotonic()
    while not ready():
        waited = time.monotonic() - t0
        if waited < SLEEP_AFTER_S:
            os.sched_yield()
        else:
            if timeout_s is not None and waited > timeout_s:
                raise TimeoutError(f"a rank did not reach the collective within {timeout_s:.0f} s")
            time.sleep(SLEEP_S)


def new_path() -> str:
    return f"/dev/shm/mmserve-tp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
