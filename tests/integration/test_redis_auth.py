"""Redis with a password, through ``shared.redis_client``: the credentials of a ``redis://`` and
a ``redis+cluster://`` URL reach every connection (on a cluster, the nodes discovered from the
first seed too), sync and asyncio; a wrong password is refused, never ignored. Real servers: an
ACL user on the shared test Redis and on each node of the session's Redis Cluster (removed after;
the default users other tests rely on are left as they are)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import uuid
from urllib.parse import quote

import pytest
import redis

from shared.redis_client import ERRORS, async_client, sync_client
from tests.redis_acl import acl_user

pytestmark = pytest.mark.integration


def test_a_single_redis_gets_the_urls_user_and_password():
    pw = "p@ss/w:rd%" + secrets.token_hex(8)  # characters a URL must percent-encode
    with acl_user(keys=("mmserve:test:auth:*",), password=pw) as user:
        url = f"redis://{user.name}:{quote(pw, safe='')}@127.0.0.1:6379/0"
        key = f"mmserve:test:auth:{uuid.uuid4().hex}"
        c = sync_client(url)
        try:
            c.set(key, b"v", ex=60)
            assert c.get(key) == b"v" and c.acl_whoami() == user.name
            c.delete(key)
        finally:
            c.close()

        async def go():
            a = async_client(url)
            try:
                return await a.acl_whoami()
            finally:
                await a.aclose()

        assert asyncio.run(go()) == user.name
        bad = sync_client(f"redis://{user.name}:wrong@127.0.0.1:6379/0")
        with pytest.raises(redis.AuthenticationError):
            bad.ping()
        bad.close()
        assert issubclass(redis.AuthenticationError, ERRORS)  # the services treat it as Redis down


@contextlib.contextmanager
def cluster_user(cluster, password: str):
    """An ACL user on every node (a cluster does not propagate ACLs)."""
    name = f"mmserve-test-{secrets.token_hex(4)}"
    for p in cluster.ports:
        with cluster.node(p) as r:
            r.acl_setuser(name, enabled=True, passwords=[f"+{password}"], keys=["mmserve:test:*"],
                          commands=["+@all", "-@dangerous", "+cluster|slots", "+cluster|shards", "+cluster|nodes",
                                    "+cluster|info"], reset=True)
    try:
        yield name
    finally:
        for p in cluster.ports:
            with cluster.node(p) as r:
                r.acl_deluser(name)


def test_a_cluster_gets_the_password_on_every_node(redis_cluster):
    pw = secrets.token_hex(16)
    seeds = ",".join(f"127.0.0.1:{p}" for p in redis_cluster.ports)
    prefix = f"mmserve:test:auth:{uuid.uuid4().hex[:8]}:"
    keys = [f"{prefix}{i}" for i in range(24)]  # spread over every node's slots
    assert len({redis_cluster.node_of(k) for k in keys}) == len(redis_cluster.ports)
    with cluster_user(redis_cluster, pw) as name:
        url = f"redis+cluster://{name}:{pw}@{seeds}"
        c = sync_client(url)
        try:
            for k in keys:
                c.set(k, k, ex=60)
            assert [c.get(k) for k in keys] == [k.encode() for k in keys]
            for k in keys:
                c.delete(k)
        finally:
            c.close()

        async def go():
            a = async_client(url)
            try:
                await a.set(keys[0], b"x", ex=60)
                await a.set(keys[-1], b"y", ex=60)
                got = [await a.get(keys[0]), await a.get(keys[-1])]
                await a.delete(keys[0])
                await a.delete(keys[-1])
                return got
            finally:
                await a.aclose()

        assert asyncio.run(go()) == [b"x", b"y"]
        with pytest.raises(ERRORS):
            sync_client(f"redis+cluster://{name}:wrong@{seeds}").ping()
