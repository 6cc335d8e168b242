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
an arbitrary address, nor carry the service token there): a request whose items name only
sources outside it gets a 400 ``media_source_not_allowed``; names in it are resolved, so a
headless Service's pods (which the gateway names by address) are allowed by the Service's name.
A response is streamed and cut past ``max_bytes`` (and past what the item can need: rows x hidden
x 8 bytes plus 1 MiB). What is read from Redis carries an HMAC under the peer key
(``shared.peer_auth``): a value whose tag does not check out is a miss, counted
(``mmserve_peer_auth_failures_total{source="embedding"}``), never used. An item no source serves (evicted, encoder gone) raises
``MediaUnavailable``: the request then fails with 409 ``media_unavailable`` and the gateway
re-sends it by value. Each fetched item is counted by where it was read
(``mmserve_llm_media_fetch_source_total{source="redis"|"http"}``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from urllib.parse import quote, urlsplit

import httpx
import torch

from shared.bounded_read import TooLarge, read_bounded
from shared.settings import THIS_MACHINE
from shared.embedding_store import DEFAULT_PREFIX, entry_key, from_bytes, open_entry
from shared.peer_auth import PeerKey
from shared.redis_client import ERRORS, async_client
from shared.schemas import EncodeResult
from shared.wire import WireError, unpack

from llm_svc.types.request import EmbeddingRef

log = logging.getLogger(__name__)

MEDIA_UNAVAILABLE = "media_unavailable"
MEDIA_SOURCE_NOT_ALLOWED = "media_source_not_allowed"
ALLOW_SETTING = "MMSERVE_LLM_MEDIA_FETCH_ALLOW"
MAX_BYTES_SETTING = "MMSERVE_LLM_MEDIA_FETCH_MAX_BYTES"
_THREAD_BYTES = 256 * 1024  # bodies past this are unpacked off the event loop
RESOLVE_S = 5.0  # an allowed name's addresses are re-resolved at most this often
_HEADER_SLACK = 1024 * 1024  # an embeddings response beyond its tensor's bytes: the wire header


class MediaUnavailable(Exception):
    """No source served an item's embeddings; ``status`` / ``code`` are what the client sees."""

    status = 409
    code = MEDIA_UNAVAILABLE

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class MediaSourceRefused(MediaUnavailable):
    """Every source an item names is outside ``MMSERVE_LLM_MEDIA_FETCH_ALLOW``: the request is
    wrong (or hostile), not the encoders, so it is a 400 the gateway does not retry by value."""

    status = 400
    code = MEDIA_SOURCE_NOT_ALLOWED


class SourceAllowList:
    """Encoder origins the front may fetch from, each entry a host name (``encoder``,
    ``localhost``: resolved, every address it has is allowed), an IP address or network
    (``127.0.0.1``, ``10.0.0.0/8``, ``fd00::/8``), optionally with ``:port`` (``[v6]:port``)."""

    def __init__(self, entries: list[str], resolve_s: float = RESOLVE_S) -> None:
        self.hosts: list[tuple[str, int | None]] = []
        self.nets: list[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, int | None]] = []
        self.resolve_s = resolve_s
        self._resolved: dict[str, tuple[float, frozenset[str]]] = {}
        for e in entries:
            host, port = _split_entry(e)
            if not host:
                continue
            try:
                self.nets.append((ipaddress.ip_network(host, strict=False), port))
            except ValueError:
                self.hosts.append((host, port))

    def __bool__(self) -> bool:
        return bool(self.hosts or self.nets)

    async def permits(self, source: str) -> bool:
        """Whether ``source`` (an http(s) base URL) is one of the allowed encoders."""
        try:
            parts = urlsplit(source)
            host = (parts.hostname or "").lower()
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            return False
        if parts.scheme not in ("http", "https") or not host or parts.username or parts.password:
            return False
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            ip = None
        if ip is not None and any(ip in n and p in (None, port) for n, p in self.nets):
            return True
        for name, p in self.hosts:
            if p not in (None, port):
                continue
            if host == name:
                return True
            if ip is not None and str(ip) in await self._addresses(name, ip):
                return True
        return False

    async def _addresses(self, name: str, wanted) -> frozenset[str]:
        """``name``'s addresses, re-resolved at most every ``resolve_s`` seconds (sooner never:
        a request naming an unknown address must not make the front hammer DNS)."""
        now = time.monotonic()
        at, addrs = self._resolved.get(name, (-1e18, frozenset()))
        if now - at >= self.resolve_s:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM)
                addrs = frozenset(str(ipaddress.ip_address(i[4][0].split("%")[0])) for i in infos)
            except (OSError, ValueError):
                addrs = frozenset()
            self._resolved[name] = (now, addrs)
        return addrs


def _split_entry(entry: str) -> tuple[str, int | None]:
    """``host``, ``host:port``, ``[v6]:port``, ``v6``, ``net/len`` or ``http://host:port`` ->
    (host, port or None)."""
    e = entry.strip().lower()
    if "://" in e:
        parts = urlsplit(e)
        return (parts.hostname or ""), parts.port
    if e.startswith("["):
        host, _, rest = e[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") and rest[1:].isdigit() else None
    if e.count(":") == 1:
        host, _, port = e.partition(":")
        if port.isdigit():
            return host, int(port)
    return e, None


class EmbeddingFetcher:
    """``metrics``: an ``LLMMetrics`` (fetched / missed items and bytes are counted here, skipped
    ones by the caller, which knows what the prefix cache covered). ``allow``: the encoders it may
    fetch from (``SourceAllowList`` entries; None: this machine's, as the setting's default; empty:
    none, Redis only). ``headers`` (the
    service token) go to those only. ``peer``: the key the encoders' Redis entries are tagged
    under (None: the development key)."""

    def __init__(self, hidden_size: int, timeout: float, metrics=None, client: httpx.AsyncClient | None = None,
                 redis_url: str | None = None, redis_prefix: str = DEFAULT_PREFIX, redis_timeout: float = 0.5,
                 allow: list[str] | None = None, headers: dict[str, str] | None = None,
                 max_bytes: int = 256 * 1024 * 1024, peer: PeerKey | None = None):
        self.hidden_size = hidden_size
        self.allow = SourceAllowList(list(THIS_MACHINE) if allow is None else allow)
        if not self.allow:
            log.warning("%s is empty: media sent by reference is read from Redis only (a miss is re-sent by "
                        "value); set it to the encoders' hosts", ALLOW_SETTING)
        self.max_bytes = max_bytes
        self.peer = peer or PeerKey.development()
        self.timeout = timeout
        self.metrics = metrics
        # never redirected: an allowed encoder cannot send the token on to another address
        self._client = client or httpx.AsyncClient(timeout=httpx.Timeout(timeout), trust_env=False, headers=headers,
                                                   follow_redirects=False)
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
                allowed = [src for src in ref.sources if await self.allow.permits(src)]
                if ref.sources and not allowed and self.allow:
                    self._count("missed")
                    raise MediaSourceRefused(f"media sent by reference names sources that are not this service's "
                                             f"encoders ({ALLOW_SETTING}); send the media by value")
                if len(allowed) < len(ref.sources):
                    why.append(f"{len(ref.sources) - len(allowed)} source(s) outside {ALLOW_SETTING}")
                if self._redis is not None:
                    t = await self._from_redis(ref, why)
                    if t is not None:
                        return t
                for src in allowed:
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
        if not data:
            why.append("redis: no entry")
            return None
        body = open_entry(self.peer, ref.key, data)
        if body is None:  # planted, or written under another key: never used
            why.append("redis: an entry that failed its HMAC check")
            if self.metrics is not None:
                self.metrics.peer_auth_failures.labels("embedding").inc()
            return None
        t = from_bytes(ref.key, body)
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
        limit = min(self.max_bytes, ref.num_tokens * self.hidden_size * 8 + _HEADER_SLACK)
        try:
            content = await self._get(url, limit)
        except httpx.HTTPError as e:
            why.append(f"{src}: {type(e).__name__}")
            return None
        except TooLarge:
            why.append(f"{src}: a response past {limit} bytes ({MAX_BYTES_SETTING}, or more than the item needs)")
            return None
        if isinstance(content, int):
            why.append(f"{src}: HTTP {content}")
            return None
        try:
            if len(content) > _THREAD_BYTES:
                tensors, _ = await asyncio.to_thread(unpack, content, EncodeResult)
            else:
                tensors, _ = unpack(content, EncodeResult)
            t = self._check(tensors.get("embeds"), ref)
        except (WireError, ValueError) as e:
            log.warning("bad embeddings for %s from %s: %s", ref.key, src, e)
            why.append(f"{src}: {e}")
            return None
        self._count("fetched", source="http")
        if self.metrics is not None:
            self.metrics.media_bytes.inc(len(content))
        return t

    async def _get(self, url: str, limit: int) -> bytes | int:
        """The body of a 200 (decoded; at most ``limit`` bytes, else ``TooLarge``), or the status."""
        async with self._client.stream("GET", url) as r:
            if r.status_code != 200:
                return r.status_code
            return await read_bounded(r.aiter_bytes(), limit, r.headers.get("content-length"))

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
