"""Redis clients for every service, from one URL: a single Redis or a Redis Cluster.

Every Redis setting (``MMSERVE_ENCODER_REDIS_URL``, ``MMSERVE_LLM_KV_L3_URL``,
``MMSERVE_LLM_MEDIA_REDIS_URL``, ``MMSERVE_{LLM,GATEWAY}_KV_EVENTS_URL``) takes either form:

* ``redis://[user:pass@]host:port[/db]`` (also ``rediss://``, ``unix://``): one Redis, handed to
  ``redis.Redis.from_url`` exactly as written;
* ``redis+cluster://[user:pass@]host:port[,host:port...][?options]`` (``rediss+cluster://`` for
  TLS): a Redis Cluster, discovered from any one of the seed nodes listed (list several so that
  a start-up survives one of them being down). A cluster has database 0 only: a path or ``db``
  other than 0 is refused.

Credentials come from the URL (percent-encode what a URL must): ``user:password@`` (an ACL user)
or ``:password@`` (``requirepass``); on a cluster they reach every node, the ones discovered
from the seeds too (tests/integration/test_redis_auth.py, against real servers).

What the users do is cluster-safe by construction: every command names one key, and a pipeline
(never a transaction, never a Lua script or MGET) may span slots: redis-py's cluster pipeline
sends each command to the node owning its key. Keys that are read together carry a ``{...}``
hash tag all the same (one node per pipeline: ``llm_svc.offload.l3``). ``scan_iter`` on a
cluster client walks every primary. ``ERRORS`` are what any of these clients raise when Redis
is down, unreachable or unhappy (a cluster's client errors are not all ``RedisError``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode

import redis
import redis.asyncio as aioredis
from redis.asyncio import cluster as aiocluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException, RedisError
from redis.retry import Retry

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
ERRORS: tuple[type[BaseException], ...] = (RedisError, RedisClusterException, OSError)


@dataclass(frozen=True)
class ClusterURL:
    """A ``redis+cluster://`` URL taken apart: ``url`` is the first seed as redis-py reads it
    (scheme, credentials and options kept), ``seeds`` every ``(host, port)`` listed."""

    url: str
    seeds: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        assert self.seeds, "a cluster URL names at least one seed"


def is_cluster(url: str) -> bool:
    return url.split("://", 1)[0].lower() in CLUSTER_SCHEMES


def parse_cluster_url(url: str) -> ClusterURL:
    """Split ``redis+cluster://[auth@]h1:p1,h2:p2[/0][?opts]``; ``ValueError`` on a bad one."""
    scheme, sep, rest = url.partition("://")
    base = CLUSTER_SCHEMES.get(scheme.lower()) if sep else None
    if base is None:
        raise ValueError(f"not a Redis Cluster URL (redis+cluster:// or rediss+cluster://): {url!r}")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    auth, _, hosts = netloc.rpartition("@")
    if path.strip("/") not in ("", "0"):
        raise ValueError(f"a Redis Cluster has database 0 only: {url!r}")
    options = parse_qsl(query, keep_blank_values=True)
    if any(k == "db" and v not in ("", "0") for k, v in options):
        raise ValueError(f"a Redis Cluster has database 0 only: {url!r}")
    options = [(k, v) for k, v in options if k != "db"]
    seeds = tuple(_host_port(h, url) for h in hosts.split(",") if h.strip())
    if not seeds:
        raise ValueError(f"a Redis Cluster URL names no seed node: {url!r}")
    host, port = seeds[0]
    shown = f"[{host}]" if ":" in host else host
    first = f"{base}://{auth + '@' if auth else ''}{shown}:{port}" + (f"/?{urlencode(options)}" if options else "")
    return ClusterURL(first, seeds)


def _host_port(item: str, url: str) -> tuple[str, int]:
    item = item.strip()
    if item.startswith("["):  # [ipv6]:port
        host, _, port = item[1:].partition("]")
        port = port.lstrip(":")
    else:
        host, _, port = item.rpartition(":") if ":" in item else (item, "", "")
    try:
        return unquote(host), int(port) if port else 6379
    except ValueError:
        raise ValueError(f"bad seed {item!r} in Redis Cluster URL {url!r}") from None


def _cluster_kwargs(kwargs: dict[str, Any], retry_cls: type = Retry) -> dict[str, Any]:
    """A single client's options for a cluster client: ``retry_on_timeout=False`` (fail fast,
    the caller backs off) becomes a cluster retry policy of no retries; a cluster moves on from
    MOVED / ASK redirections on its own, whatever the policy."""
    kw = dict(kwargs)
    if kw.pop("retry_on_timeout", None) is False:
        kw.setdefault("retry", retry_cls(NoBackoff(), 0))
    return kw


def sync_client(url: str, **kwargs: Any) -> redis.Redis | RedisCluster:
    """A blocking client. A cluster's client connects (to learn the slots) right here and
    raises one of ``ERRORS`` when no seed answers; a single Redis's connects on first use."""
    if not is_cluster(url):
        return redis.Redis.from_url(url, **kwargs)
    c = parse_cluster_url(url)
    return RedisCluster.from_url(c.url, startup_nodes=[ClusterNode(h, p) for h, p in c.seeds[1:]],
                                 **_cluster_kwargs(kwargs))


def async_client(url: str, **kwargs: Any) -> aioredis.Redis | aiocluster.RedisCluster:
    """An asyncio client; either kind connects on first use."""
    if not is_cluster(url):
        return aioredis.from_url(url, **kwargs)
    c = parse_cluster_url(url)
    return aiocluster.RedisCluster.from_url(
        c.url, startup_nodes=[aiocluster.ClusterNode(h, p) for h, p in c.seeds[1:]],
        **_cluster_kwargs(kwargs, AsyncRetry))
