"""This replica's KV events (``shared.kv_events``): the engine core reports the router keys its
prefix tree stored and removed; the publisher keeps the held set (served as ``/kv/snapshot``)
and appends each change to the Redis stream, from a background task (never on the caller's
path). Redis being down or slow costs events, not requests: a bounded backlog drops its oldest
and readers see the gap and reload the snapshot.

Every replica appends to the one stream key, so on a Redis Cluster (``redis+cluster://``) the
stream lives on the node owning its slot and a gateway reads every replica's events with one
single-key XREAD; the pipeline of XADDs names that one key, never a transaction. Each entry is
tagged under the peer key (``shared.kv_events``), which the gateways check."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import deque

from shared.kv_events import KVEvent, KVSnapshot
from shared.peer_auth import PeerKey
from shared.redis_client import ERRORS, async_client

log = logging.getLogger(__name__)

BACKLOG = 4096  # events waiting for Redis
RETRY_S = 1.0


class KVPublisher:
    def __init__(self, url: str, stream: str, maxlen: int, peer: PeerKey | None = None) -> None:
        """``peer``: the key every gateway checks entries under (None: the development key)."""
        self.peer = peer or PeerKey.development()
        self.instance = secrets.token_hex(8)
        self.stream, self.maxlen = stream, maxlen
        self.seq = 0
        self.keys: set[int] = set()
        self.published = self.dropped = 0
        self._backlog: deque[KVEvent] = deque(maxlen=BACKLOG)
        self._wake = asyncio.Event()
        self._redis = async_client(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._redis.aclose()

    def apply(self, stored: list[int], removed: list[int]) -> None:
        """The core's tree now holds ``stored`` and no longer ``removed``."""
        stored = [k for k in stored if k not in self.keys]
        removed = [k for k in removed if k in self.keys]
        if stored or removed:
            self.keys.update(stored)
            self.keys.difference_update(removed)
            self._emit(KVEvent(self.instance, self.seq + 1, stored, removed))

    def reset(self) -> None:
        """The core restarted with an empty tree."""
        if self.keys:
            self.keys.clear()
            self._emit(KVEvent(self.instance, self.seq + 1, clear=True))

    def snapshot(self) -> KVSnapshot:
        return KVSnapshot(instance=self.instance, seq=self.seq, keys=sorted(self.keys))

    def _emit(self, ev: KVEvent) -> None:
        self.seq = ev.seq
        if len(self._backlog) == self._backlog.maxlen:
            self.dropped += 1  # readers see the gap and reload the snapshot
        self._backlog.append(ev)
        self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._backlog:
                batch = list(self._backlog)
                try:
                    async with self._redis.pipeline(transaction=False) as pipe:
                        for ev in batch:
                            pipe.xadd(self.stream, ev.fields(self.stream, self.peer), maxlen=self.maxlen, approximate=True)
                        await pipe.execute()
                except ERRORS as e:
                    log.warning("KV events: Redis unavailable (%s); retrying", e)
                    await asyncio.sleep(RETRY_S)
                    continue
                while self._backlog and self._backlog[0].seq <= batch[-1].seq:
                    self._backlog.popleft()
                self.published += len(batch)
