"""Host shared-memory tier: one file per entry in a tmpfs directory (``/dev/shm``).

Worker processes on one host point at the same directory and share entries. Writes are atomic
(temp file + ``os.replace``); a hit refreshes the file's mtime, and the budget is enforced by
deleting the least recently used files (oldest mtime) whenever this process's running estimate
of the directory's size passes the budget; the estimate is re-measured by a scan each time.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

import torch
import xxhash

from encoder_svc.cache.base import CacheTier, from_bytes, to_bytes

DEFAULT_DIR = "/dev/shm/mmserve-encoder-cache"
_SUFFIX = ".st"


class SharedMemoryTier(CacheTier):
    name = "shm"

    def __init__(self, max_bytes: int, directory: str | Path = DEFAULT_DIR) -> None:
        if max_bytes < 1:
            raise ValueError("max_bytes must be >= 1")
        self.max_bytes = max_bytes
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._estimate = self._scan_total()

    def _path(self, key: str) -> Path:
        return self.dir / (xxhash.xxh3_128_hexdigest(key.encode()) + _SUFFIX)

    def _entries(self) -> list[tuple[float, int, Path]]:
        out = []
        with os.scandir(self.dir) as it:
            for e in it:
                if e.name.endswith(_SUFFIX):
                    try:
                        st = e.stat()
                    except FileNotFoundError:  # removed by another process meanwhile
                        continue
                    out.append((st.st_mtime, st.st_size, Path(e.path)))
        return out

    def _scan_total(self) -> int:
        return sum(size for _, size, _ in self._entries())

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

    async def put(self, key: str, value: torch.Tensor) -> None:
        data = to_bytes(key, value)
        if len(data) > self.max_bytes:
            return
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self._path(key))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        with self._lock:
            self._estimate += len(data)
            if self._estimate > self.max_bytes:
                self._evict()

    def _evict(self) -> None:
        entries = sorted(self._entries())  # oldest mtime first
        total = sum(size for _, size, _ in entries)
        for _, size, path in entries:
            if total <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size
        self._estimate = total

    def nbytes(self) -> int:
        return self._scan_total()

    def clear(self) -> None:
        for _, _, path in self._entries():
            path.unlink(missing_ok=True)
        self._estimate = 0

    def check_integrity(self) -> None:
        total = self._scan_total()
        assert total <= self.max_bytes, f"{self.dir} holds {total} bytes, budget {self.max_bytes}"
        stale = [p for p in self.dir.iterdir() if p.name.startswith(".tmp-") and time.time() - p.stat().st_mtime > 60]
        assert not stale, f"leaked temp files {stale}"
