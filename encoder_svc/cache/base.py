"""The cache-tier contract and the tensor <-> bytes codec shared by the byte-storing tiers."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from shared.embedding_store import from_bytes, to_bytes  # noqa: F401  (the byte-storing tiers' codec)


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
