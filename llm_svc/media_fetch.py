"""Embeddings sent by reference, fetched by the front from the encoders that serve them.

``EmbeddingFetcher.fetch_many`` reads each item from the encoders' Redis tier when one is
configured (``redis_url``: the encoders' ``MMSERVE_ENCODER_REDIS_URL``, same key prefix), else
or on a miss ``GET {source}/v1/embeddings/{key}``, the item's sources tried in order within
``timeout`` seconds (the encoder that encoded it first; others share its Redis or
shared-memory tier). Concurrent fetches of one key share one request
(single flight), and one waiter leaving never cancels it for the others. What comes back is
checked against the reference (rows == num_tokens, hidden size, floating point, finite) before
the engine sees it. ``allow`` (hosts or CIDR networks) limits which encoders the front will
fetch from: a source outside it is never contacted (a request body cannot make the LLM reach
an arbitrary address). An item no source serves (evicted, encoder gone) raises
``MediaUnavailable``: the request then fails with 409 ``media_unavailable`` and the gateway
re-sends it by value. Each fetched item is counted by where it was read
(``mmserve_llm_media_fetch_source_total{source="redis"|"http"}``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from urllib.parse import quote, urlsplit

import httpx
import torch

from shared.embedding_store import DEFAULT_PREFIX, entry_key, from_bytes
from shared.redis_client import ERRORS, async_client
from shared.schemas import EncodeResult
from shared.wire import WireError, unpack

from .types import EmbeddingRef

log = logging.getLogger(__name__)

MEDIA_UNAVAILABLE = "media_unavailable"
_THREAD_BYTES = 256 * 1024  # bodies past this are unpacked off the event loop


class MediaUnavailable(Exception):
    """No source served an item's embeddings; ``status`` / ``code`` are what the client sees."""

    status = 409
    code = MEDIA_UNAVAILABLE

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class SourceAllowList:
    """Encoder origins the front may fetch from: each entry a host name (``encoder``,
    ``localhost``) or an IP network (``127.0.0.1``, ``10.0.0.0/8``, ``fd00::/8``)."""

    def __init__(self, entries: list[str]) -> None:
        self.hosts: set[str] = set()
        self.nets: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for e in entries:
            e = e.strip().lower()
            if not e:
                continue
            try:
                self.nets.append(ipaddress.ip_network(e, strict=False))
            except ValueError:
                self.hosts.add(e)

    def permits(self, source: str) -> bool:
        try:
            parts = urlsplit(source)
            host = (parts.hostname or "").lower()
        except ValueError:
            return False
        if parts.scheme not in ("http", "https") or not host:
            return False
        if host in self.hosts:
            return True
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(ip in n for n in self.nets)


class EmbeddingFetcher:
    """``metrics``: an ``LLMMetrics`` (fetched / missed items and bytes are counted here, skipped
    ones by the caller, which knows what the prefix cache covered)."""

    def __init__(self, hidden_size: int, timeout: float, metrics=None, client: httpx.AsyncClient | None = None,
                 redis_url: str | None = None, redis_prefix: str = DEFAULT_PREFIX, redis_timeout: float = 0.5,
                 allow: list[str] | None = None, headers: dict[str, str] | None = None):
        self.hidden_size = hidden_size
        self.allow = SourceAllowList(allow) if allow else None
        self.timeout = timeout
        self.metrics = metrics
        self._client = client or httpx.AsyncClient(timeout=httpx.Timeout(timeout), trust_env=False, headers=headers)
        self._redis = async_client(redis_url, socket_timeout=redis_timeout, socket_connect_timeout=redis_timeout,
                                   retry_on_timeout=False) if redis_url else None
        self.redis_prefix = redis_prefix
        self.redis_hits = 0
        self._inflight: dict[str, asyncio.Task] = {}
        self.gets = 0  # HTTP fetches made (single flight: fewer than the items asked for)

    async def fetch_many(self, refs: dict[int, EmbeddingRef]) -> dict[int, torch.Tensor]:
        """Item index -> its rows of the embeddings ``[rows, hidden]`` (float, on the CPU), all
        concurrently (sub-items of one key share one fetch)."""
        keys = list(refs)
        got = await asyncio.gather(*(self.fetch(refs[i]) for i in keys))
        return dict(zip(keys, got))

    async def fetch(self, ref: EmbeddingRef) -> torch.Tensor:
        task = self._inflight.get(ref.key)
        if task is None:
            task = asyncio.ensure_future(self._fetch(ref))
            self._inflight[ref.key] = task
            task.add_done_callback(lambda t, k=ref.key: self._done(k, t))
        t = await asyncio.shield(task)
        if t.shape[0] != ref.num_tokens:  # one key, another claimed length: this request is wrong
            raise MediaUnavailable(f"the embeddings of {ref.key!r} have {t.shape[0]} rows, "
                                   f"the prompt says num_tokens={ref.num_tokens}")
        return t[ref.start : ref.start + ref.rows]

    def _done(self, key: str, task: asyncio.Task) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]
        if not task.cancelled():
            task.exception()  # retrieved: no warning when every waiter left

    async def _fetch(self, ref: EmbeddingRef) -> torch.Tensor:
        why: list[str] = []
        try:
            async with asyncio.timeout(self.timeout):
                if self._redis is not None:
                    t = await self._from_redis(ref, why)
                    if t is not None:
                        return t
                for src in ref.sources:
                    if self.allow is not None and not self.allow.permits(src):
                        why.append("a source outside MMSERVE_LLM_MEDIA_FETCH_ALLOW")
                        continue
                    t = await self._from(src, ref, why)
                    if t is not None:
                        return t
        except TimeoutError:
            why.append(f"timed out after {self.timeout:g} s")
        self._count("missed")
        raise MediaUnavailable(f"the embeddings of a media item sent by reference are not available "
                               f"({'; '.join(why) or 'no source'}); re-send the request with them")

    async def _from_redis(self, ref: EmbeddingRef, why: list[str]) -> torch.Tensor | None:
        try:
            data = await self._redis.get(entry_key(self.redis_prefix, ref.key))
        except ERRORS as e:
            why.append(f"redis: {type(e).__name__}")
            return None
        t = from_bytes(ref.key, data) if data else None
        if t is None:
            why.append("redis: no entry")
            return None
        try:
            t = self._check(t, ref)
        except ValueError as e:
            why.append(f"redis: {e}")
            return None
        self.redis_hits += 1
        self._count("fetched", source="redis")
        if self.metrics is not None:
            self.metrics.media_bytes.inc(len(data))
        return t

    async def _from(self, src: str, ref: EmbeddingRef, why: list[str]) -> torch.Tensor | None:
        url = f"{src.rstrip('/')}/v1/embeddings/{quote(ref.key, safe=':')}"
        self.gets += 1
        try:
            r = await self._client.get(url)
        except httpx.HTTPError as e:
            why.append(f"{src}: {type(e).__name__}")
            return None
        if r.status_code != 200:
            why.append(f"{src}: HTTP {r.status_code}")
            return None
        try:
            if len(r.content) > _THREAD_BYTES:
                tensors, _ = await asyncio.to_thread(unpack, r.content, EncodeResult)
            else:
                tensors, _ = unpack(r.content, EncodeResult)
            t = self._check(tensors.get("embeds"), ref)
        except (WireError, ValueError) as e:
            log.warning("bad embeddings for %s from %s: %s", ref.key, src, e)
            why.append(f"{src}: {e}")
            return None
        self._count("fetched", source="http")
        if self.metrics is not None:
            self.metrics.media_bytes.inc(len(r.content))
        return t

    def _check(self, t: torch.Tensor | None, ref: EmbeddingRef) -> torch.Tensor:
        if t is None or t.ndim != 2:
            raise ValueError(f"no 2-D tensor 'embeds' (got {None if t is None else list(t.shape)})")
        if t.shape[0] != ref.num_tokens or t.shape[1] != self.hidden_size:
            raise ValueError(f"embeddings of shape {list(t.shape)}, need [{ref.num_tokens}, {self.hidden_size}]")
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise ValueError("embeddings must be finite floating point")
        return t

    def _count(self, outcome: str, n: int = 1, source: str | None = None) -> None:
        """``source`` (``redis`` | ``http``): where a fetched item was read."""
        if self.metrics is not None and n > 0:
            self.metrics.media_refs.labels(outcome).inc(n)
            if source is not None:
                self.metrics.media_sources.labels(source).inc(n)

    def count_skipped(self, n: int) -> None:
        """Items sent by reference whose spans the prefix cache covered: never fetched."""
        self._count("skipped", n)

    def check_integrity(self) -> None:
        assert all(not t.done() for t in self._inflight.values()), "finished fetches left in flight"

    async def close(self) -> None:
        for t in list(self._inflight.values()):
            t.cancel()
        await self._client.aclose()
        if self._redis is not None:
            try:
                await self._redis.aclose()
            except ERRORS:
                pass
