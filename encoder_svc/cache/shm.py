"""Host shared-memory tier: one file per entry in a tmpfs directory (``/dev/shm``).

Worker processes on one host point at the same directory and share entries. Values are
written to a temp file and renamed into place, so readers never see a torn entry and need no
lock. Bookkeeping is shared through two files, changed only under an exclusive ``flock`` on
``.lock``: ``.total`` holds the bytes of all entries. A put that takes the total over the
budget evicts least recently used entries (oldest mtime; a hit refreshes it) down to 90 % of
the budget, re-measuring the directory while it does, so the budget holds across processes.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from encoder_svc.cache.base import CacheTier, from_bytes, to_bytes
from shared.hashing import content_hash

DEFAULT_DIR = "/dev/shm/mmserve-encoder-cache"
_SUFFIX = ".st"
_LOW_WATER = 0.9


class SharedMemoryTier(CacheTier):
    name = "shm"

    def __init__(self, max_bytes: int, directory: str | Path = DEFAULT_DIR) -> None:
        if max_bytes < 1:
            raise ValueError("max_bytes must be >= 1")
        self.max_bytes = max_bytes
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock_path = self.dir / ".lock"
        self._total_path = self.dir / ".total"
        self._thread_lock = threading.Lock()  # flock is per open file, not per thread
        with self._locked():
            if not self._total_path.exists():
                self._write_total(self._scan_total())

    # -- shared bookkeeping ----------------------------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock, open(self._lock_path, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _read_total(self) -> int:
        try:
            return int(self._total_path.read_text() or 0)
        except (FileNotFoundError, ValueError):
            return self._scan_total()

    def _write_total(self, total: int) -> None:
        tmp = self._total_path.with_suffix(".tmp")
        tmp.write_text(str(max(0, total)))
        os.replace(tmp, self._total_path)

    def _entries(self) -> list[tuple[float, int, Path]]:
        out = []
        with os.scandir(self.dir) as it:
            for e in it:
                if e.name.endswith(_SUFFIX):
                    try:
                        st = e.stat()
                    except FileNotFoundError:
                        continue
                    out.append((st.st_mtime, st.st_size, Path(e.path)))
        return out

    def _scan_total(self) -> int:
        return sum(size for _, size, _ in self._entries())

    def _path(self, key: str) -> Path:
        return self.dir / (content_hash(key.encode()) + _SUFFIX)  # SHA-256: names shared across tenants

    # -- tier ------------------------------------------------------------------------------

    async def get(self, key: str) -> torch.Tensor | None:
        p = self._path(key)
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            return None
        t = from_bytes(key, data)
        if t is not None:
            try:
                os.utime(p)
            except FileNotFoundError:
                pass
        return t

    async def put(self, key: str, value: torch.Tensor) -> bool:
        data = to_bytes(key, value)
        if len(data) > self.max_bytes:
            return False
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            target = self._path(key)
            with self._locked():
                try:
                    old = target.stat().st_size
                except FileNotFoundError:
                    old = 0
                os.replace(tmp, target)
                total = self._read_total() + len(data) - old
                if total > self.max_bytes:
                    total = self._evict()
                self._write_total(total)
        finally:
            Path(tmp).unlink(missing_ok=True)
        return True

    def _evict(self) -> int:
        """Delete oldest entries down to the low-water mark; return the measured total."""
        entries = sorted(self._entries())
        total = sum(size for _, size, _ in entries)
        for _, size, path in entries:
            if total <= self.max_bytes * _LOW_WATER:
                break
            path.unlink(missing_ok=True)
            total -= size
        return total

    def nbytes(self) -> int:
        return self._read_total()

    def clear(self) -> None:
        with self._locked():
            for _, _, path in self._entries():
                path.unlink(missing_ok=True)
            self._write_total(0)

    def check_integrity(self) -> None:
        with self._locked():
            total, recorded = self._scan_total(), self._read_total()
        assert total == recorded, f"{self.dir}: .total says {recorded} bytes, entries hold {total}"
        assert total <= self.max_bytes, f"{self.dir} holds {total} bytes, budget {self.max_bytes}"
