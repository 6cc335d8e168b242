"""Follows the LLM replicas' KV events on Redis into a ``KVIndex``.

On each (re)connection the feed notes the stream's last entry, marks every instance stale and
loads each replica's ``/kv/snapshot`` over HTTP, then reads entries after the noted one (so no
change between snapshot and stream is missed; one already in a snapshot is skipped by its seq).
A gap in an instance's seqs (events trimmed while this gateway lagged, or lost) reloads that
instance's snapshot. Reads are batched (``READ_COUNT``) and block at most ``BLOCK_MS``, so the
feed never falls behind by more than what the stream keeps. While Redis is unreachable
``connected`` is False and the router uses its own record of what it sent. An entry whose HMAC
does not check out under the peer key (``shared.kv_events``: planted in Redis) is ignored and
counted (``auth_failures``, ``on_auth_failure``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx
from pydantic import ValidationError

from shared.kv_events import SNAPSHOT_PATH, KVEvent, KVEventAuthError, KVSnapshot
from shared.peer_auth import PeerKey
from shared.redis_client import ERRORS, async_client

from .kv_index import KVIndex

log = logging.getLogger(__name__)

READ_COUNT = 1000
BLOCK_MS = 1000
RETRY_S = 1.0


class KVEventFeed:
    def __init__(self, url: str, stream: str, index: KVIndex, http: httpx.AsyncClient,
                 replicas: Callable[[], dict[str, str]], timeout: float = 2.0, peer: PeerKey | None = None,
                 on_auth_failure: Callable[[], None] | None = None) -> None:
        """``replicas()``: instance id -> base URL of the LLM replicas the gateway knows. ``peer``:
        the key entries are checked under (None: the development key); ``on_auth_failure()``:
        called for each entry ignored for its tag."""
        self.peer = peer or PeerKey.development()
        self.on_auth_failure = on_auth_failure
        self.auth_failures = 0
        self.url, self.stream = url, stream
        self.index = index
        self.http = http
        self.replicas = replicas
        self.timeout = timeout
        self.connected = False
        self.events = 0
        self.snapshots = 0

    def live(self, instance: str | None) -> bool:
        return self.connected and self.index.live(instance)

    async def run(self) -> None:
        while True:
            r = async_client(self.url, socket_connect_timeout=2.0, socket_timeout=BLOCK_MS / 1000 + 2.0)
            try:
                await self._follow(r)
            except ERRORS as e:
                if self.connected:
                    log.warning("KV events: lost Redis (%s); routing on this gateway's own record", e)
                self.connected = False
                await asyncio.sleep(RETRY_S)
            finally:
                self.connected = False
                await r.aclose()

    async def _follow(self, r) -> None:
        # one stream key: on a Redis Cluster every read goes to the node owning its slot
        last = await r.xrevrange(self.stream, count=1)
        last_id = last[0][0] if last else b"0-0"
        self.index.mark_stale()
        await self._reload()
        self.connected = True
        while True:
            got = await r.xread({self.stream: last_id}, count=READ_COUNT, block=BLOCK_MS)
            for _, entries in got or ():
                for entry_id, fields in entries:
                    last_id = entry_id
                    self._apply(fields)
            await self._reload()

    def _apply(self, fields: dict) -> None:
        try:
            ev = KVEvent.parse(fields, self.stream, self.peer)
        except KVEventAuthError as e:
            self.auth_failures += 1
            if self.on_auth_failure is not None:
                self.on_auth_failure()
            log.warning("KV events: ignoring %s", e)
            return
        except ValueError as e:
            log.warning("KV events: skipping %s", e)
            return
        self.events += 1
        self.index.apply(ev)

    async def _reload(self) -> None:
        """Load the snapshot of each known replica that is stale or not in the index, and drop
        instances no replica reports any more."""
        known = self.replicas()
        for inst in self.index.instances():
            if inst not in known:
                self.index.forget(inst)
        todo = [(i, u) for i, u in known.items() if not self.index.live(i)]
        if todo:
            await asyncio.gather(*(self._load(i, u) for i, u in todo))

    async def _load(self, instance: str, base: str) -> None:
        try:
            r = await self.http.get(base + SNAPSHOT_PATH, timeout=self.timeout)
            snap = KVSnapshot.model_validate_json(r.content) if r.status_code == 200 else None
        except (httpx.HTTPError, ValidationError) as e:
            log.debug("KV snapshot of %s failed: %s", base, e)
            return
        if snap is None or snap.instance != instance:
            return  # another instance answers there now: the next readiness probe says which
        self.index.load(snap)
        self.snapshots += 1
