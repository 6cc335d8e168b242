"""The shared L3 KV tier in Redis: pages of full KV and SWA windows, keyed by content.

Keys (``{...}`` is a Redis Cluster hash tag: a conversation's pages share its first page's tag,
so a lookup's pipelines -- every page and window of one chain -- reach one node, and different
conversations spread over the cluster's nodes)::

    mmkv:{<fp>:<h1>}:p:<h_j>   full-layer KV of tokens [(j-1)P, jP)         (page j)
    mmkv:{<fp>:<h1>}:w:<h_j>   SWA-layer KV of tokens [jP - W, jP)          (window at jP)

``h_j`` chains SHA-256 over the page keys (token ids, media keys at placeholder positions):
equal keys give equal KV, whatever request wrote them. ``fp`` fingerprints the model, its layer
geometry, the KV dtype, the page size and the window: another model never reads these keys. SWA
KV is stored only at the boundaries where a hit can land (the prompt's last page boundary,
retention points), never for every token. A value carries a header (magic, kind, tokens, the
fingerprint, the payload's size) and an HMAC-SHA256 tag under the services' peer key
(``shared.peer_auth``) over its Redis key, the header and the payload: a value planted in Redis,
or a valid one moved to another key, fails the tag and is a miss, counted (``l3_auth_failures``,
``mmserve_peer_auth_failures_total{source="kv_page"}``) and never used. The tag is checked before
anything in the value is read; anything else that does not check out is a miss as well
(``l3_corrupt`` counts every rejected value).

Redis outages: every command has short timeouts; after a failure the store is *down* for a
backoff (0.5 s doubling to 30 s) during which it is skipped (serving goes on with device +
host), then the next command reconnects. Writes and touches run on one background thread with
a bounded queue (dropped, and counted, when it is full).

``url`` may name a Redis Cluster (``redis+cluster://``, ``shared.redis_client``): pipelines are
never transactions, so a touch whose keys span conversations (slots) is split by node.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import struct
import threading
import time
from dataclasses import dataclass

import numpy as np

from shared.peer_auth import TAG_BYTES, PeerKey
from shared.redis_client import ERRORS, sync_client

log = logging.getLogger(__name__)

MAGIC = b"MMKV"
VERSION = 2  # 1: a CRC32 in place of the tag
_HEADER = struct.Struct("<4sBBI8sI")  # magic, version, kind, tokens, fingerprint, payload bytes
PAGE, WINDOW = 0, 1
DOMAIN = "kv_page"  # windows too: the key names which


class PeerAuthFailed(Exception):
    """A value's tag does not check out under the peer key."""


def fingerprint(parts: dict) -> str:
    """16 hex chars naming what KV bytes mean: model, geometry, dtype, page size, window."""
    blob = repr(sorted(parts.items())).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def chain_hashes(keys: list[int], page: int) -> list[bytes]:
    """``h_1 .. h_J`` for the ``J = len(keys) // page`` whole pages of ``keys``."""
    arr = np.asarray(keys, dtype=np.int64)
    out: list[bytes] = []
    h = b""
    for j in range(len(keys) // page):
        h = hashlib.sha256(h + arr[j * page:(j + 1) * page].tobytes()).digest()[:16]
        out.append(h)
    return out


def encode(kind: int, tokens: int, fp: str, payload: bytes, key: str, peer: PeerKey) -> bytes:
    """The stored value of ``payload`` under the Redis key ``key``: header, tag, payload."""
    header = _HEADER.pack(MAGIC, VERSION, kind, tokens, bytes.fromhex(fp), len(payload))
    return b"".join((header, peer.tag(DOMAIN, key, header, payload), payload))


def decode(value: bytes | None, kind: int, tokens: int, fp: str, nbytes: int, key: str,
           peer: PeerKey) -> bytes | None:
    """The payload, or None if ``value`` is missing or not the expected page / window. Raises
    ``PeerAuthFailed`` when its tag (checked first, before anything in it is trusted) does not
    check out under ``peer`` for ``key``: planted, moved, truncated or written under another key."""
    if value is None:
        return None
    head = _HEADER.size + TAG_BYTES
    mv = memoryview(value)
    if len(value) < head or not peer.verify(mv[_HEADER.size:head], DOMAIN, key, mv[:_HEADER.size], mv[head:]):
        raise PeerAuthFailed(key)
    magic, version, k, n, f, size = _HEADER.unpack_from(value)
    if (magic, version, k, n, f) != (MAGIC, VERSION, kind, tokens, bytes.fromhex(fp)):
        return None
    if size != nbytes or len(value) - head != nbytes:
        return None
    return value[head:]


@dataclass
class L3Hit:
    """Pages ``page_start .. length/P - 1`` (payloads) and the window before ``length``."""

    length: int
    page_start: int
    pages: list[bytes]
    window: bytes
    window_tokens: int


class L3Store:
    """Redis-backed pages and windows for one model fingerprint (see the module doc)."""

    def __init__(self, url: str, fp: str, page: int, window: int, full_token_bytes: int, swa_token_bytes: int,
                 ttl_s: int = 86400, timeout_s: float = 0.5, max_queue: int = 256,
                 peer: PeerKey | None = None) -> None:
        """``peer``: the key values are tagged under, shared by every replica (None: the
        development key, ``shared.peer_auth``)."""
        self.url = url
        self.peer = peer or PeerKey.development()
        self._client_opts = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False)
        self._client = None
        self._client_lock = threading.Lock()
        self.fp, self.page, self.window, self.ttl = fp, page, window, ttl_s
        self.full_token_bytes, self.swa_token_bytes = full_token_bytes, swa_token_bytes
        self._down_until = 0.0
        self._backoff = 0.5
        self._q: queue.Queue = queue.Queue(maxsize=max_queue)
        self._touched: dict[str, float] = {}
        self.stats = {
            "l3_lookups": 0, "l3_hits": 0, "l3_hit_tokens": 0, "l3_misses": 0, "l3_corrupt": 0, "l3_auth_failures": 0,
            "l3_bytes_read": 0, "l3_bytes_written": 0, "l3_pages_written": 0, "l3_windows_written": 0,
            "l3_touches": 0, "l3_errors": 0, "l3_skipped": 0, "l3_dropped_writes": 0, "l3_rejected_writes": 0,
            "l3_up": 1,
        }
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._writer, name="l3-writer", daemon=True)
        self._thread.start()

    @property
    def client(self):
        """The Redis client, made on first use: a cluster's client connects to learn the slots when
        it is made, so a cluster down at start-up is an outage like any other (``ERRORS``)."""
        with self._client_lock:
            if self._client is None:
                self._client = sync_client(self.url, **self._client_opts)
            return self._client

    # ------------------------------------------------------------------ keys
    def _tag(self, hashes: list[bytes]) -> str:
        return f"mmkv:{{{self.fp}:{hashes[0][:6].hex()}}}"

    def page_key(self, hashes: list[bytes], j: int) -> str:
        """Key of page ``j`` (1-based) of the chain ``hashes``."""
        return f"{self._tag(hashes)}:p:{hashes[j - 1].hex()}"

    def window_key(self, hashes: list[bytes], j: int) -> str:
        return f"{self._tag(hashes)}:w:{hashes[j - 1].hex()}"

    def seal(self, kind: int, tokens: int, key: str, payload: bytes) -> bytes:
        """The value to store under ``key`` (``encode`` with this store's fingerprint and key)."""
        return encode(kind, tokens, self.fp, payload, key, self.peer)

    # ------------------------------------------------------------------ health
    @property
    def up(self) -> bool:
        return time.monotonic() >= self._down_until

    def _ok(self) -> None:
        with self._lock:
            self._backoff = 0.5
            self.stats["l3_up"] = 1

    def _failed(self, e: Exception) -> None:
        with self._lock:
            self.stats["l3_errors"] += 1
            self.stats["l3_up"] = 0
            if self.up:
                log.warning("L3 KV store unreachable (%s: %s); serving from device + host for %.1f s",
                            type(e).__name__, e, self._backoff)
            self._down_until = time.monotonic() + self._backoff
            self._backoff = min(30.0, self._backoff * 2)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.stats[name] += n

    # ------------------------------------------------------------------ reads (caller's thread)
    def lookup(self, keys: list[int], local: int, raw: int) -> L3Hit | None:
        """The longest hit past ``local`` tokens (what the tree already serves), fetching pages
        from the one holding position ``raw`` (the tree has full KV below it). None on a miss,
        a corrupt value or an outage."""
        if not self.up:
            self._count("l3_skipped")
            return None
        hashes = chain_hashes(keys, self.page)
        if len(hashes) * self.page <= local:
            return None
        self._count("l3_lookups")
        try:
            pipe = self.client.pipeline(transaction=False)
            for j in range(1, len(hashes) + 1):
                pipe.exists(self.page_key(hashes, j))
                pipe.exists(self.window_key(hashes, j))
            flags = pipe.execute()
            best = 0
            for j in range(1, len(hashes) + 1):
                if not flags[2 * (j - 1)]:
                    break
                if flags[2 * (j - 1) + 1]:
                    best = j
            if best * self.page <= local:
                self._count("l3_misses")
                self._ok()
                return None
            start = min(raw, best * self.page) // self.page  # 0-based index of the first page to fetch
            pipe = self.client.pipeline(transaction=False)
            for j in range(start + 1, best + 1):
                pipe.get(self.page_key(hashes, j))
            pipe.get(self.window_key(hashes, best))
            values = pipe.execute()
            self._ok()
        except ERRORS as e:
            self._failed(e)
            return None
        pages = []
        wt = min(self.window, best * self.page)
        try:
            for j, v in zip(range(start + 1, best + 1), values[:-1]):
                p = decode(v, PAGE, self.page, self.fp, self.page * self.full_token_bytes, self.page_key(hashes, j),
                           self.peer)
                if p is None:
                    self._count("l3_corrupt")
                    return None
                pages.append(p)
            win = decode(values[-1], WINDOW, wt, self.fp, wt * self.swa_token_bytes, self.window_key(hashes, best),
                         self.peer)
        except PeerAuthFailed:
            self._count("l3_corrupt")
            self._count("l3_auth_failures")
            return None
        if win is None:
            self._count("l3_corrupt")
            return None
        self._count("l3_hits")
        self._count("l3_bytes_read", sum(len(v) for v in values))
        return L3Hit(best * self.page, start, pages, win, wt)

    # ------------------------------------------------------------------ writes (background)
    def put(self, items: list[tuple[str, bytes]], n_pages: int, n_windows: int) -> None:
        """Queue ``(key, value)`` writes (with the TTL)."""
        self._submit(("put", items, n_pages, n_windows))

    def touch(self, keys: list[str]) -> None:
        """Refresh the TTL (and LRU clock) of ``keys``, each at most every ``ttl/10`` seconds."""
        now = time.monotonic()
        due = [k for k in keys if now - self._touched.get(k, -1e18) >= self.ttl / 10]
        if not due:
            return
        for k in due:
            self._touched[k] = now
        if len(self._touched) > 100_000:
            self._touched.clear()
        self._submit(("touch", due))

    def _submit(self, job) -> None:
        if not self.up:
            self._count("l3_skipped")
            return
        try:
            self._q.put_nowait(job)
        except queue.Full:
            self._count("l3_dropped_writes")

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until queued writes are done (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while (self._q.unfinished_tasks and time.monotonic() < deadline):
            time.sleep(0.005)

    def close(self) -> None:
        self._stop = True
        self._submit(None)

    def _writer(self) -> None:
        from redis.exceptions import ClusterError, RedisClusterException, ResponseError

        while True:
            job = self._q.get()
            try:
                if job is None or self._stop:
                    return
                if not self.up:
                    self._count("l3_skipped")
                    continue
                pipe = self.client.pipeline(transaction=False)
                if job[0] == "put":
                    _, items, n_pages, n_windows = job
                    for k, v in items:
                        pipe.set(k, v, ex=self.ttl)
                    pipe.execute()
                    self._count("l3_bytes_written", sum(len(v) for _, v in items))
                    self._count("l3_pages_written", n_pages)
                    self._count("l3_windows_written", n_windows)
                else:
                    for k in job[1]:
                        pipe.expire(k, self.ttl)
                    pipe.execute()
                    self._count("l3_touches", len(job[1]))
                self._ok()
            except (ClusterError, RedisClusterException) as e:  # CLUSTERDOWN is a ResponseError too
                self._failed(e)
            except ResponseError as e:  # e.g. OOM under maxmemory + noeviction: full, not down
                self._count("l3_rejected_writes")
                log.debug("L3 refused a write: %s", e)
            except ERRORS as e:
                self._failed(e)
            except Exception:  # never let the writer die
                log.exception("L3 writer job failed")
            finally:
                self._q.task_done()
