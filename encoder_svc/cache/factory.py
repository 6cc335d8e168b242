"""Build the service's cache from settings: memory if ``cache_bytes``, shared memory if
``shm_cache_bytes``, Redis if ``redis_url``; None when all are off."""

from __future__ import annotations

from encoder_svc.cache.base import CacheTier
from encoder_svc.cache.memory import MemoryLRU
from encoder_svc.cache.redis_tier import RedisTier
from encoder_svc.cache.shm import DEFAULT_DIR, SharedMemoryTier
from encoder_svc.cache.tiered import TieredCache
from encoder_svc.metrics import EncoderMetrics
from shared.peer_auth import resolve
from shared.settings import EncoderSettings


def build_cache(settings: EncoderSettings, metrics: EncoderMetrics | None = None,
                shm_dir: str = DEFAULT_DIR, redis_prefix: str = "mmserve:enc:") -> TieredCache | None:
    tiers: list[CacheTier] = []
    if settings.cache_bytes > 0:
        tiers.append(MemoryLRU(settings.cache_bytes))
    if settings.shm_cache_bytes > 0:
        tiers.append(SharedMemoryTier(settings.shm_cache_bytes, shm_dir))
    if settings.redis_url:
        on_error = (lambda tier: metrics.cache_errors.labels(tier).inc()) if metrics is not None else None
        on_auth = (lambda: metrics.peer_auth_failures.labels("embedding").inc()) if metrics is not None else None
        tiers.append(RedisTier(settings.redis_url, settings.redis_ttl_s, settings.redis_max_bytes,
                               prefix=redis_prefix, on_error=on_error, on_auth_failure=on_auth,
                               peer=resolve(settings.peer_key, [settings.redis_url], "MMSERVE_ENCODER_PEER_KEY")))
    return TieredCache(tiers, metrics) if tiers else None
