"""The cache-tier contract and the tensor <-> bytes codec shared by the byte-storing tiers."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save


class CacheTier(ABC):
    """One level of the embedding cache.

    Contract: ``get`` returns the tensor stored under ``key`` or None; ``put`` may drop the
    entry (too large, budget, tier unavailable) but never raises for an unavailable backend,
    and returns whether it stored it;
    a tier never holds more than its byte budget once ``put`` returns; ``check_integrity``
    raises ``AssertionError`` when the tier's accounting is inconsistent.
    """

    name: str = ""

    @abstractmethod
    async def get(self, key: str) -> torch.Tensor | None: ...

    @abstractmethod
    async def put(self, key: str, value: torch.Tensor) -> bool: ...

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes this tier accounts for (as last known, for remote tiers)."""

    def check_integrity(self) -> None:  # noqa: B027 - optional for tiers without local state
        pass

    async def close(self) -> None:  # noqa: B027
        pass


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def to_bytes(key: str, t: torch.Tensor) -> bytes:
    """The key travels with the value so a hash collision or a stale file is detected on read."""
    return st_save({"embeds": t.detach().contiguous().cpu()}, metadata={"key": key})


def from_bytes(key: str, data: bytes) -> torch.Tensor | None:
    import json

    try:
        n = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8 : 8 + n]).get("__metadata__") or {}
        if meta.get("key") != key:
            return None
        return st_load(bytes(data))["embeds"]
    except Exception:  # a torn or foreign value is a miss, not an error
        return None
