"""A pool of replicas behind configured base URLs: hostnames expanded to one replica per DNS
A record (re-resolved periodically) and a background /readyz prober that marks replicas down
and up again.  Routing policies read ``routable()``; they never probe.

A replica that answers "not ready" or refuses connections is down: its host is up, so its open
streams still flow (a draining replica finishes what it holds).  One that does not answer at all
(timeouts, no route: a host cut off, a hung process) for ``fail_threshold`` probes in a row is
also *lost*: ``on_lost`` listeners hear of it, so that callers stop waiting on it."""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable
from urllib.parse import urlsplit

import httpx

log = logging.getLogger("mmserve.gateway.replicas")

HostResolver = Callable[[str, int], Awaitable[list[str]]]
# True: ready; False: answered, not ready (or refused the connection); None: no answer at all
Prober = Callable[[str], Awaitable[bool | None]]
_SILENT_ERRNOS = frozenset({errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ETIMEDOUT})


async def resolve_ipv4(host: str, port: int) -> list[str]:
    """A records of ``host`` (sorted, de-duplicated)."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, family=socket.AF_INET, type=socket.SOCK_STREAM
    )
    return sorted({info[4][0] for info in infos})


def unreachable(e: BaseException) -> bool:
    """``e`` (an httpx error) says the peer never answered: a timeout, or no route to its host.
    A refused connection is an answer (the host is up, nothing listens there)."""
    if isinstance(e, httpx.TimeoutException):
        return True
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in _SILENT_ERRNOS:
            return True
        cur = cur.__cause__ or cur.__context__
    text = str(e)
    return "No route to host" in text or "Network is unreachable" in text


def http_prober(
    client: httpx.AsyncClient, timeout: float = 2.0, on_ready: Callable[[str, object], None] | None = None
) -> Prober:
    """A prober that calls ``GET {url}/readyz`` and wants a 200 (None when nothing answered:
    see ``unreachable``); ``on_ready(url, json_body)`` sees each ready answer (replicas report
    their limits there)."""

    async def probe(url: str) -> bool:
        try:
            r = await client.get(f"{url}/readyz", timeout=timeout)
            if r.status_code == 200 and on_ready is not None:
                try:
                    on_ready(url, r.json())
                except ValueError:
                    pass
            return r.status_code == 200
        except httpx.HTTPError as e:
            return None if unreachable(e) else False

    return probe


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


class ReplicaPool:
    """Replicas of one service.  ``routable()`` is the healthy replicas, or all of them when none
    is known healthy (a stale health view should not refuse traffic the replicas could serve)."""

    def __init__(
        self,
        name: str,
        urls: Iterable[str],
        *,
        resolver: HostResolver = resolve_ipv4,
        prober: Prober | None = None,
        fail_threshold: int = 1,
    ) -> None:
        if fail_threshold < 1:
            raise ValueError("fail_threshold must be >= 1")
        self.name = name
        self.urls = [u.rstrip("/") for u in urls]
        self._resolver = resolver
        self._prober = prober
        self._replicas: list[str] = list(dict.fromkeys(self.urls))
        self._down: set[str] = set()
        # consecutive failed probes per replica: one slow probe on a busy host must not
        # reshuffle the ring (and every encoder cache behind it)
        self.fail_threshold = fail_threshold
        self._fails: dict[str, int] = {}
        self._silent: dict[str, int] = {}  # consecutive probes that got no answer at all
        self._listeners: list[Callable[[], None]] = []
        self._lost_listeners: list[Callable[[str], None]] = []
        self._probing = False  # True while run() probes, so a marked-down replica can come back

    # ---- views ----------------------------------------------------------------------------
    def replicas(self) -> list[str]:
        return list(self._replicas)

    def healthy(self) -> list[str]:
        return [r for r in self._replicas if r not in self._down]

    def routable(self) -> list[str]:
        return self.healthy() or self.replicas()

    def on_change(self, callback: Callable[[], None]) -> None:
        """``callback()`` runs whenever the replica list or the health of one changes."""
        self._listeners.append(callback)
        callback()

    def lost(self) -> list[str]:
        """Replicas that gave no answer at all to the last ``fail_threshold`` probes."""
        return [r for r in self._replicas if self._silent.get(r, 0) >= self.fail_threshold]

    def on_lost(self, callback: Callable[[str], None]) -> None:
        """``callback(replica)`` runs after every probe round that finds ``replica`` lost."""
        self._lost_listeners.append(callback)

    def _changed(self) -> None:
        for cb in self._listeners:
            cb()

    # ---- updates --------------------------------------------------------------------------
    def mark_down(self, url: str) -> None:
        if url in self._replicas and url not in self._down:
            log.warning("%s replica %s marked down", self.name, url)
            self._down.add(url)
            self._changed()

    def report_failure(self, url: str) -> None:
        """A request could not connect to ``url``: take it out of rotation until a probe finds it
        ready again (ignored when nothing probes, or it would be out for good)."""
        if self._probing:
            self.mark_down(url)

    def mark_up(self, url: str) -> None:
        if url in self._down:
            log.info("%s replica %s is back", self.name, url)
            self._down.discard(url)
            self._changed()

    def set_replicas(self, replicas: Iterable[str]) -> None:
        new = list(dict.fromkeys(replicas))
        if new != self._replicas:
            log.info("%s replicas: %s", self.name, new)
            self._replicas = new
            self._down &= set(new)
            for gone in set(self._silent) - set(new):
                del self._silent[gone]
            self._changed()

    async def expand(self, url: str) -> list[str]:
        """One URL per A record of the URL's host (https and IP literals stay as they are)."""
        parts = urlsplit(url)
        host = parts.hostname or ""
        if parts.scheme != "http" or not host or _is_ip(host):
            return [url]
        port = parts.port or 80
        try:
            ips = await self._resolver(host, port)
        except OSError as e:
            log.warning("%s: cannot resolve %s: %s", self.name, host, e)
            return [url]
        return [parts._replace(netloc=f"{ip}:{port}").geturl() for ip in ips] or [url]

    async def refresh_dns(self) -> None:
        expanded = await asyncio.gather(*(self.expand(u) for u in self.urls))
        self.set_replicas(r for group in expanded for r in group)

    async def probe_all(self) -> None:
        if self._prober is None:
            return
        replicas = self.replicas()
        results = await asyncio.gather(*(self._prober(r) for r in replicas))
        for r, ok in zip(replicas, results):
            if ok:
                self._fails.pop(r, None)
                self._silent.pop(r, None)
                self.mark_up(r)
                continue
            self._fails[r] = self._fails.get(r, 0) + 1
            if ok is None:
                self._silent[r] = self._silent.get(r, 0) + 1
            else:
                self._silent.pop(r, None)
            if self._fails[r] >= self.fail_threshold:
                self.mark_down(r)
            if self._silent.get(r, 0) >= self.fail_threshold:
                for cb in self._lost_listeners:
                    cb(r)

    async def any_ready(self) -> bool:
        """Probe now: does at least one replica answer ready?"""
        if self._prober is None:
            return bool(self._replicas)
        results = await asyncio.gather(*(self._prober(r) for r in self.replicas()))
        return any(results)

    async def run(self, health_interval: float, dns_interval: float) -> None:
        """Background loop: DNS every ``dns_interval`` s, probes every ``health_interval`` s
        (0 disables either).  Runs until cancelled."""
        loop = asyncio.get_running_loop()
        next_dns = next_probe = loop.time()
        self._probing = health_interval > 0 and self._prober is not None
        while True:
            now = loop.time()
            try:
                if dns_interval > 0 and now >= next_dns:
                    await self.refresh_dns()
                    next_dns = now + dns_interval
                if health_interval > 0 and now >= next_probe:
                    await self.probe_all()
                    next_probe = now + health_interval
            except Exception:  # keep the loop alive whatever one round does
                log.exception("%s: replica refresh failed", self.name)
            waits = [t - loop.time() for t, iv in ((next_dns, dns_interval), (next_probe, health_interval)) if iv > 0]
            if not waits:
                return
            await asyncio.sleep(max(0.05, min(waits)))
