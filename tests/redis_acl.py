"""A throw-away Redis ACL user on the test Redis (127.0.0.1:6379), for tests that need Redis
with a password without changing the default user every other test shares."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from dataclasses import dataclass

import redis

REDIS = "redis://127.0.0.1:6379/0"


@dataclass(frozen=True)
class ACLUser:
    name: str
    password: str

    def url(self, host: str = "127.0.0.1:6379", scheme: str = "redis") -> str:
        return f"{scheme}://{self.name}:{self.password}@{host}/0"


@contextlib.contextmanager
def acl_user(keys: tuple[str, ...] = ("mmserve:*", "mmkv:*"), password: str | None = None) -> Iterator[ACLUser]:
    """A user that may run every non-dangerous command on ``keys`` (glob patterns), deleted after."""
    admin = redis.Redis.from_url(REDIS)
    user = ACLUser(f"mmserve-test-{secrets.token_hex(4)}", password or secrets.token_hex(24))
    admin.acl_setuser(user.name, enabled=True, passwords=[f"+{user.password}"], keys=list(keys),
                      channels=["*"], commands=["+@all", "-@dangerous"], reset=True)
    try:
        yield user
    finally:
        admin.acl_deluser(user.name)
        admin.close()


def clients_of(user: ACLUser) -> int:
    """Connections the test Redis has open for ``user``."""
    admin = redis.Redis.from_url(REDIS)
    try:
        return sum(1 for c in admin.client_list() if c.get("user") == user.name)
    finally:
        admin.close()
