"""The cache the service talks to: tiers tried fastest first, a hit promoted to faster tiers."""

from __future__ import annotations

import torch

from encoder_svc.cache.base import CacheTier
from encoder_svc.metrics import EncoderMetrics


class TieredCache:
    def __init__(self, tiers: list[CacheTier], metrics: EncoderMetrics | None = None) -> None:
        if not tiers:
            raise ValueError("a cache needs at least one tier")
        self.tiers = tiers
        self._metrics = metrics

    def _count(self, tier: CacheTier, modality: str, result: str) -> None:
        if self._metrics is not None:
            self._metrics.cache_lookups.labels(tier.name, modality, result).inc()

    def _gauge(self, tier: CacheTier) -> None:
        if self._metrics is not None:
            self._metrics.cache_bytes.labels(tier.name).set(tier.nbytes())

    async def get(self, key: str, modality: str) -> torch.Tensor | None:
        for i, tier in enumerate(self.tiers):
            value = await tier.get(key)
            if value is None:
                self._count(tier, modality, "miss")
                continue
            self._count(tier, modality, "hit")
            for faster in self.tiers[:i]:
                await faster.put(key, value)
                self._gauge(faster)
            return value
        return None

    async def put(self, key: str, modality: str, value: torch.Tensor) -> bool:
        """Stores in every tier that takes it; True if at least one did."""
        stored = False
        for tier in self.tiers:
            stored = await tier.put(key, value) or stored
            self._gauge(tier)
        return stored

    def check_integrity(self) -> None:
        for tier in self.tiers:
            tier.check_integrity()

    async def close(self) -> None:
        for tier in self.tiers:
            await tier.close()
