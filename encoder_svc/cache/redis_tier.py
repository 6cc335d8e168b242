"""Redis tier: entries shared by every encoder replica, with a TTL.

One key per entry, ``{prefix}e:{<media key>}`` (safetensors bytes, ``SET ... EX ttl``), and
every command touches one key: no Lua script, no sorted set or counter to keep in step, so it
is safe on Redis Cluster (``redis+cluster://``, ``shared.redis_client``; the braces are a hash
tag: anything ever stored beside an entry under the same tag lands in its slot, while entries
spread over the nodes) and Redis's own eviction owns the budget: run Redis with
``maxmemory`` and ``maxmemory-policy allkeys-lru`` (compose.yaml does), where bookkeeping keys
would be evicted independently of the entries they describe. ``max_bytes`` caps one entry.

Values are sealed with an HMAC under the peer key (``shared.embedding_store.seal_entry``): an
entry whose tag does not check out (planted, moved from another key) is a miss, reported to
``on_auth_failure`` (``mmserve_peer_auth_failures_total{source="embedding"}``), never used.

Any Redis failure degrades to a miss / a skipped store with a warning; after a failure the tier
is skipped for ``retry_after`` seconds instead of retrying on every request.
"""

from __future__ import annotations

import logging
import time

import torch

from encoder_svc.cache.base import CacheTier, from_bytes, to_bytes
from shared.embedding_store import entry_key, open_entry, seal_entry
from shared.peer_auth import PeerKey
from shared.redis_client import ERRORS, async_client

log = logging.getLogger(__name__)


class RedisTier(CacheTier):
    name = "redis"

    def __init__(self, url: str, ttl_s: int, max_bytes: int, prefix: str = "mmserve:enc:",
                 timeout_s: float = 0.5, retry_after: float = 2.0, on_error=None, peer: PeerKey | None = None,
                 on_auth_failure=None) -> None:
        """``peer``: the key entries are tagged under (None: the development key);
        ``on_auth_failure()``: called for each entry read whose tag does not check out."""
        if ttl_s < 1 or max_bytes < 1:
            raise ValueError("ttl_s and max_bytes must be >= 1")
        self.url, self.ttl_s, self.max_bytes, self.prefix = url, ttl_s, max_bytes, prefix
        self.retry_after = retry_after
        self._on_error = on_error
        self.peer = peer or PeerKey.development()
        self._on_auth_failure = on_auth_failure
        self.auth_failures = 0
        self._client = async_client(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False
        )
        self._down_until = 0.0
        self._bytes = 0  # bytes this process stored (Redis's INFO memory has the real figure)

    def entry_key(self, key: str) -> str:
        return entry_key(self.prefix, key)

    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, op: str, e: Exception) -> None:
        if self.available():
            log.warning("redis cache %s failed (%s: %s); caching locally for %.0f s",
                        op, type(e).__name__, e, self.retry_after)
        self._down_until = time.monotonic() + self.retry_after
        if self._on_error is not None:
            self._on_error(self.name)

    async def get(self, key: str) -> torch.Tensor | None:
        if not self.available():
            return None
        try:
            data = await self._client.get(self.entry_key(key))  # a read refreshes its LRU clock
        except ERRORS as e:
            self._failed("get", e)
            return None
        if not data:
            return None
        body = open_entry(self.peer, key, data)
        if body is None:
            self.auth_failures += 1
            if self._on_auth_failure is not None:
                self._on_auth_failure()
            return None
        return from_bytes(key, body)

    async def put(self, key: str, value: torch.Tensor) -> bool:
        if not self.available():
            return False
        data = seal_entry(self.peer, key, to_bytes(key, value))
        if len(data) > self.max_bytes:
            return False
        try:
            await self._client.set(self.entry_key(key), data, ex=self.ttl_s)
            self._bytes += len(data)
        except ERRORS as e:
            self._failed("put", e)
            return False
        return True

    def nbytes(self) -> int:
        return self._bytes

    async def clear(self) -> None:
        """Delete every key under this tier's prefix (tests, operators; on a cluster the scan
        walks every primary)."""
        async for k in self._client.scan_iter(match=f"{self.prefix}*", count=500):
            await self._client.delete(k)
        self._bytes = 0

    async def remote_integrity(self) -> None:
        """Every key under the prefix is an entry with a TTL (needs Redis; for tests)."""
        async for k in self._client.scan_iter(match=f"{self.prefix}*", count=500):
            name = k.decode()
            assert name.startswith(f"{self.prefix}e:{{") and name.endswith("}"), name
            assert await self._client.ttl(k) > 0, f"{name} never expires"

    async def close(self) -> None:
        try:
            await self._client.aclose()
        except ERRORS:
            pass
