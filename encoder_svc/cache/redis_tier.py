"""Redis tier: entries shared by every encoder replica, with a TTL and a byte budget.

Layout under ``prefix``: ``{prefix}e:{key}`` values (safetensors bytes, ``EX ttl``), a sorted
set ``{prefix}lru`` (key -> last use), a hash ``{prefix}sizes`` and a counter ``{prefix}bytes``.
A Lua script stores an entry and evicts least recently used ones until the counter is within
the budget, atomically. An entry that expires by TTL keeps counting against the budget until
it is evicted (the accounting errs on the safe side). Any Redis failure degrades to a miss / a skipped store with a warning;
after a failure the tier is skipped for ``retry_after`` seconds instead of retrying on every
request.
"""

from __future__ import annotations

import logging
import time

import redis.asyncio as aioredis
import torch
from redis.exceptions import RedisError

from encoder_svc.cache.base import CacheTier, from_bytes, to_bytes

log = logging.getLogger(__name__)

_PUT = """
local old = redis.call('HGET', KEYS[3], KEYS[1])
if old then redis.call('DECRBY', KEYS[4], old) end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], KEYS[1])
redis.call('HSET', KEYS[3], KEYS[1], string.len(ARGV[1]))
local total = redis.call('INCRBY', KEYS[4], string.len(ARGV[1]))
local budget = tonumber(ARGV[4])
while total > budget do
  local victim = redis.call('ZPOPMIN', KEYS[2])
  if #victim == 0 then break end
  local size = redis.call('HGET', KEYS[3], victim[1])
  redis.call('HDEL', KEYS[3], victim[1])
  redis.call('DEL', victim[1])
  if size then total = redis.call('DECRBY', KEYS[4], size) end
end
-- bookkeeping lives as long as the newest entry: once every entry has expired, so has it
redis.call('EXPIRE', KEYS[2], ARGV[2])
redis.call('EXPIRE', KEYS[3], ARGV[2])
redis.call('EXPIRE', KEYS[4], ARGV[2])
return total
"""


class RedisTier(CacheTier):
    name = "redis"

    def __init__(self, url: str, ttl_s: int, max_bytes: int, prefix: str = "mmserve:enc:",
                 timeout_s: float = 0.5, retry_after: float = 2.0, on_error=None) -> None:
        if ttl_s < 1 or max_bytes < 1:
            raise ValueError("ttl_s and max_bytes must be >= 1")
        self.url, self.ttl_s, self.max_bytes, self.prefix = url, ttl_s, max_bytes, prefix
        self.retry_after = retry_after
        self._on_error = on_error
        self._client = aioredis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False
        )
        self._down_until = 0.0
        self._bytes = 0
        self._put_script = self._client.register_script(_PUT)

    def _keys(self, key: str) -> list[str]:
        p = self.prefix
        return [f"{p}e:{key}", f"{p}lru", f"{p}sizes", f"{p}bytes"]

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
        k, lru, _, _ = self._keys(key)
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.get(k)
                pipe.zadd(lru, {k: time.time()}, xx=True)
                data, _ = await pipe.execute()
        except (RedisError, OSError) as e:
            self._failed("get", e)
            return None
        return from_bytes(key, data) if data else None

    async def put(self, key: str, value: torch.Tensor) -> None:
        if not self.available():
            return
        data = to_bytes(key, value)
        if len(data) > self.max_bytes:
            return
        try:
            self._bytes = int(await self._put_script(keys=self._keys(key),
                                                      args=[data, self.ttl_s, time.time(), self.max_bytes]))
        except (RedisError, OSError) as e:
            self._failed("put", e)

    def nbytes(self) -> int:
        return self._bytes

    async def clear(self) -> None:
        """Delete every key under this tier's prefix (tests, operators)."""
        async for k in self._client.scan_iter(match=f"{self.prefix}*", count=500):
            await self._client.delete(k)
        self._bytes = 0

    async def remote_integrity(self) -> None:
        """Counter == sum of recorded sizes <= budget (needs Redis; for tests)."""
        _, lru, sizes, counter = self._keys("")
        recorded = await self._client.hgetall(sizes)
        total = int(await self._client.get(counter) or 0)
        assert total == sum(int(v) for v in recorded.values()), (total, recorded)
        assert total <= self.max_bytes, f"{total} bytes over the budget {self.max_bytes}"
        assert await self._client.zcard(lru) == len(recorded)

    async def close(self) -> None:
        try:
            await self._client.aclose()
        except (RedisError, OSError):
            pass
