"""SSRF guard: a media URL may only reach public addresses, unless allow-listed.

``SSRFGuard.check(url)`` resolves the host and returns a ``Target`` pinned to one checked
address; the fetcher connects to that address (Host header and TLS SNI keep the name), so a
second DNS answer cannot swap in a private address between check and connect.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], Awaitable[list[str]]]


class SSRFError(ValueError):
    """The URL may not be fetched (scheme, host or address refused)."""


@dataclass(frozen=True)
class Target:
    """A URL checked by the guard, with the address to connect to."""

    url: str
    scheme: str
    host: str  # as written in the URL (no brackets)
    port: int
    ip: str

    def pinned_url(self) -> str:
        """The URL with the host replaced by the checked address."""
        parts = urlsplit(self.url)
        ip = f"[{self.ip}]" if ":" in self.ip else self.ip
        netloc = f"{ip}:{self.port}"
        return parts._replace(netloc=netloc).geturl()


async def system_resolver(host: str, port: int) -> list[str]:
    """All addresses ``host`` resolves to (A and AAAA)."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )
    return list(dict.fromkeys(info[4][0] for info in infos))


_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address reaches (mapped, NAT64, 6to4, Teredo), if any."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    return None


def is_public(ip: IPAddress) -> bool:
    """False for private, loopback, link-local, multicast, reserved, unspecified and other
    non-global ranges (IPv6 that embeds an IPv4 address is judged by that address)."""
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(ip)
        if embedded is not None:
            return is_public(embedded)
        if ip.is_site_local:
            return False  # fec0::/10: deprecated site-local, still routed inside sites; 3.11 calls it global
    if (
        ip.is_private
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
    ):
        return False
    return ip.is_global


class SSRFGuard:
    """Refuses URLs whose host resolves to a non-public address.

    ``allowed`` holds hostnames (exact, case-insensitive), IP addresses or CIDRs that are exempt.
    A host is refused when *any* of its addresses is refused, so round-robin DNS cannot smuggle a
    private address in."""

    def __init__(self, allowed: Iterable[str] = (), resolver: Resolver = system_resolver) -> None:
        self._names: set[str] = set()
        self._nets: list[IPNetwork] = []
        for entry in allowed:
            entry = entry.strip()
            if not entry:
                continue
            try:
                self._nets.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                self._names.add(entry.lower().rstrip("."))
        self._resolve = resolver

    def ip_allowed(self, ip: IPAddress) -> bool:
        return is_public(ip) or any(ip in net for net in self._nets)

    async def check(self, url: str) -> Target:
        """Return the pinned target for ``url`` or raise ``SSRFError``."""
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as e:
            raise SSRFError(f"malformed URL: {e}") from e
        if parts.scheme not in ("http", "https"):
            raise SSRFError(f"URL scheme {parts.scheme!r} is not allowed (use http, https or data)")
        host = (parts.hostname or "").rstrip(".")
        if not host:
            raise SSRFError("URL has no host")
        if parts.username or parts.password:
            raise SSRFError("URLs with credentials are not allowed")
        port = port or (443 if parts.scheme == "https" else 80)
        try:
            addrs = [ipaddress.ip_address(host)]
        except ValueError:
            try:
                addrs = [ipaddress.ip_address(a.split("%")[0]) for a in await self._resolve(host, port)]
            except (OSError, UnicodeError) as e:
                raise SSRFError(f"cannot resolve host {host!r}: {e}") from e
        if not addrs:
            raise SSRFError(f"host {host!r} has no addresses")
        if host.lower() not in self._names:
            refused = [a for a in addrs if not self.ip_allowed(a)]
            if refused:
                raise SSRFError(
                    f"host {host!r} resolves to non-public address {refused[0]} "
                    "(add it to allowed_hosts to permit)"
                )
        return Target(url=url, scheme=parts.scheme, host=host, port=port, ip=str(addrs[0]))
