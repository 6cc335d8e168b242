"""In-process LRU tier bounded in bytes."""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from encoder_svc.cache.base import CacheTier, tensor_nbytes


class MemoryLRU(CacheTier):
    name = "memory"

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError("max_bytes must be >= 1")
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    async def get(self, key: str) -> torch.Tensor | None:
        with self._lock:
            t = self._items.get(key)
            if t is not None:
                self._items.move_to_end(key)
            return t

    async def put(self, key: str, value: torch.Tensor) -> bool:
        size = tensor_nbytes(value)
        if size > self.max_bytes:
            return False
        value = value.detach().cpu()
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= tensor_nbytes(old)
            while self._items and self._bytes + size > self.max_bytes:
                _, evicted = self._items.popitem(last=False)
                self._bytes -= tensor_nbytes(evicted)
            self._items[key] = value
            self._bytes += size
        return True

    def nbytes(self) -> int:
        return self._bytes

    def clear(self) -> None:
        """Drop every entry (operators, tests)."""
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def check_integrity(self) -> None:
        with self._lock:
            total = sum(tensor_nbytes(t) for t in self._items.values())
            assert total == self._bytes, f"accounted {self._bytes} bytes, holds {total}"
            assert self._bytes <= self.max_bytes, f"{self._bytes} bytes over the budget {self.max_bytes}"
