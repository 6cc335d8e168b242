"""HMAC on every value one service writes to Redis and another reads back.

Redis is shared by every replica, and anyone who can write to it could plant a KV page, an
embedding or a KV event that changes another user's output. Each such value therefore carries
an HMAC-SHA256 tag under a key the services share (``MMSERVE_{ENCODER,LLM,GATEWAY}_PEER_KEY``),
computed over a *domain* (what the value is: ``kv_page``, ``embedding``, ``kv_event``), the
value's *identity* (its Redis key, or stream and event id) and the value's bytes: a valid value
copied to another key, or reinterpreted as another kind, fails. Readers check the tag (in
constant time) before they use anything in the value; a bad tag is a miss, counted on the
reader's ``/metrics`` as ``mmserve_peer_auth_failures_total{source=...}``.

No key set: when every Redis the service uses is on this machine (loopback, a unix socket) the
services fall back to one fixed development key and warn at start; a Redis elsewhere without a
key refuses to start, naming the setting. Make a key with ``openssl rand -hex 32``.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import struct
from collections.abc import Iterable
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

TAG_BYTES = 32  # HMAC-SHA256
MIN_KEY_CHARS = 16
# the fallback of a single-machine setup; public, so it authenticates nothing against a local writer
_DEV_KEY = b"mmserve development peer key: set MMSERVE_*_PEER_KEY (openssl rand -hex 32)"
_warned: set[str] = set()


class PeerKey:
    """An HMAC key shared by the services. ``fallback``: the fixed development key."""

    __slots__ = ("_key", "fallback")

    def __init__(self, key: bytes, fallback: bool = False) -> None:
        if not key:
            raise ValueError("an empty peer key")
        self._key = key
        self.fallback = fallback

    def __repr__(self) -> str:  # never the key itself
        return f"PeerKey({'fallback' if self.fallback else 'set'})"

    @classmethod
    def development(cls) -> "PeerKey":
        """The fixed key used when none is set and Redis is local (and by tests)."""
        return cls(_DEV_KEY, fallback=True)

    def tag(self, domain: str, identity: str | bytes, *parts: bytes | bytearray | memoryview) -> bytes:
        """HMAC-SHA256 over ``domain``, ``identity`` and ``parts`` (each length-prefixed, so no two
        different inputs give the same message)."""
        h = hmac.new(self._key, digestmod=hashlib.sha256)
        ident = identity.encode() if isinstance(identity, str) else identity
        for piece in (domain.encode(), ident):
            h.update(struct.pack("<Q", len(piece)))
            h.update(piece)
        for p in parts:
            h.update(struct.pack("<Q", memoryview(p).nbytes))
            h.update(p)
        return h.digest()

    def verify(self, tag: bytes | bytearray | memoryview, domain: str, identity: str | bytes,
               *parts: bytes | bytearray | memoryview) -> bool:
        """Whether ``tag`` is this key's tag of the rest (constant-time compare)."""
        return len(tag) == TAG_BYTES and hmac.compare_digest(bytes(tag), self.tag(domain, identity, *parts))

    def seal(self, domain: str, identity: str, value: bytes) -> bytes:
        """``tag + value``: what is stored."""
        return self.tag(domain, identity, value) + value

    def open(self, domain: str, identity: str, sealed: bytes | None) -> bytes | None:
        """The value of a ``seal``-ed blob, or None when its tag does not check out (or it is
        too short to carry one)."""
        if sealed is None or len(sealed) < TAG_BYTES:
            return None
        mv = memoryview(sealed)
        value = mv[TAG_BYTES:]
        if not self.verify(mv[:TAG_BYTES], domain, identity, value):
            return None
        return bytes(value)


def redis_hosts(url: str) -> list[str]:
    """The hosts a Redis URL names (every seed of a ``redis+cluster://`` URL); ``""`` for a unix
    socket. Credentials are never returned."""
    from shared.redis_client import is_cluster, parse_cluster_url

    if is_cluster(url):
        return [h for h, _ in parse_cluster_url(url).seeds]
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return [""]
    return [parts.hostname or ""]


def _local(host: str) -> bool:
    if host in ("", "localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def resolve(secret: str | None, urls: Iterable[str | None], setting: str) -> PeerKey:
    """The peer key a service uses with the Redis ``urls`` it is configured with. ``setting``
    names the environment variable in messages. Raises ``ValueError`` when no key is set and a
    Redis is on another machine; warns once per setting when it falls back to the fixed key."""
    if secret:
        if len(secret) < MIN_KEY_CHARS:
            raise ValueError(f"{setting} must be at least {MIN_KEY_CHARS} characters (openssl rand -hex 32)")
        return PeerKey(secret.encode())
    remote = [h for u in urls if u for h in redis_hosts(u) if not _local(h)]
    if remote:
        raise ValueError(f"{setting} is not set and Redis ({remote[0]}) is not on this machine: set the same "
                         f"key (openssl rand -hex 32) on every service, or anyone who can write to that Redis "
                         f"can change what the services serve")
    if setting not in _warned and any(urls):
        _warned.add(setting)
        log.warning("%s is not set: values read back from Redis are authenticated with a fixed development key; "
                    "set it (openssl rand -hex 32) on every service before Redis leaves this machine", setting)
    return PeerKey.development()
