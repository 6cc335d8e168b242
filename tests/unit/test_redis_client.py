"""shared.redis_client: one URL setting, single Redis or Redis Cluster. A ``redis://`` URL gives
the very client the services built before (same class, same connection options); a
``redis+cluster://`` URL gives redis-py's cluster clients seeded with every node listed; the
settings refuse a malformed cluster URL; and the Kubernetes example for an external cluster
points every service at it."""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.asyncio import cluster as aiocluster

from shared.redis_client import ERRORS, async_client, is_cluster, parse_cluster_url, sync_client
from shared.settings import EncoderSettings, GatewaySettings, LLMSettings

pytestmark = pytest.mark.unit

OPTS = dict(socket_timeout=0.5, socket_connect_timeout=0.25, retry_on_timeout=False)


def test_cluster_urls_are_taken_apart():
    c = parse_cluster_url("redis+cluster://h1:7000,h2:7001,[::1]:7002")
    assert c.url == "redis://h1:7000" and c.seeds == (("h1", 7000), ("h2", 7001), ("::1", 7002))
    c = parse_cluster_url("rediss+cluster://user:p%40ss@h1,h2:7001/0?ssl_cert_reqs=none&db=0")
    assert c.url == "rediss://user:p%40ss@h1:6379/?ssl_cert_reqs=none"  # auth and options kept, db dropped
    assert c.seeds == (("h1", 6379), ("h2", 7001))
    assert is_cluster("REDIS+CLUSTER://h:1") and not is_cluster("redis://h:1/0") and not is_cluster("unix:///s")
    for bad in ("redis://h:1", "redis+cluster://h:1/2", "redis+cluster://h:1?db=3", "redis+cluster://",
                "redis+cluster://h:port"):
        with pytest.raises(ValueError):
            parse_cluster_url(bad)


def plain(kwargs: dict) -> dict:
    """The options that are values (not per-client objects such as handlers)."""
    return {k: v for k, v in kwargs.items() if v is None or isinstance(v, (str, int, float, bool))}


def test_a_single_redis_url_builds_the_same_client_as_before():
    url = "redis://127.0.0.1:6390/3"
    for mine, theirs in ((sync_client(url, **OPTS), redis.Redis.from_url(url, **OPTS)),
                         (async_client(url, **OPTS), aioredis.from_url(url, **OPTS))):
        assert type(mine) is type(theirs)
        assert plain(mine.connection_pool.connection_kwargs) == plain(theirs.connection_pool.connection_kwargs)
        assert mine.connection_pool.connection_kwargs["db"] == 3
        assert mine.connection_pool.connection_kwargs["retry_on_timeout"] is False


def test_a_cluster_url_builds_a_cluster_client_seeded_with_every_node():
    async def go():
        c = async_client("redis+cluster://127.0.0.1:7000,127.0.0.1:7001", **OPTS)
        try:
            assert isinstance(c, aiocluster.RedisCluster)
            assert sorted(n.port for n in c.nodes_manager.startup_nodes.values()) == [7000, 7001]
            assert c.get_connection_kwargs()["socket_timeout"] == 0.5
        finally:
            await c.aclose()

    asyncio.run(go())  # lazy: nothing listens on those ports, and nothing connected
    # the blocking cluster client connects when made: with no node up it raises one of ERRORS
    with pytest.raises(ERRORS):
        sync_client("redis+cluster://127.0.0.1:1", socket_timeout=0.2, socket_connect_timeout=0.2)


def test_every_redis_setting_takes_either_form_and_refuses_a_bad_cluster_url():
    good, bad = "redis+cluster://a:7000,b:7001", "redis+cluster://a:7000/1"
    fields = [(EncoderSettings, "redis_url"), (LLMSettings, "kv_l3_url"), (LLMSettings, "media_redis_url"),
              (LLMSettings, "kv_events_url"), (GatewaySettings, "kv_events_url")]
    for cls, name in fields:
        base = {"model_dir": "m"} if cls is not GatewaySettings else {}
        for url in (good, "redis://r:6379/0"):
            assert getattr(cls(**base, **{name: url}), name) == url
        with pytest.raises(ValidationError, match="database 0 only"):
            cls(**base, **{name: bad})


def test_k8s_external_redis_cluster_component_points_every_service_at_it(monkeypatch):
    """components/redis-cluster replaces the mmserve-redis scheme and hosts with a cluster's and
    drops the in-namespace Redis: every service container then reads that cluster, with the
    generated Redis password, in each Redis setting."""
    from tests.unit.test_k8s_manifests import NAMESPACE, SETTINGS, _kustomize, container_env, k8s_tree, \
        secret_files, service_containers

    tree = k8s_tree()  # deploy/k8s with its Secrets' files made
    with tempfile.TemporaryDirectory() as tmp:
        rel = lambda p: os.path.relpath(tree / p, tmp)  # noqa: E731
        Path(tmp, "kustomization.yaml").write_text(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
            f"namespace: {NAMESPACE}\nresources: [{rel('overlays/cpu')}]\ncomponents: [{rel('components/redis-cluster')}]\n")
        objs = _kustomize(Path(tmp))
    assert not [o for o in objs if o["metadata"]["name"] == "mmserve-redis" and o["kind"] not in ("ConfigMap",)]
    [cm] = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("mmserve-redis")]
    d = cm["data"]
    url = f"{d['scheme']}://{d['user']}:{secret_files()['redis-password']}@{d['hosts']}/0"
    assert is_cluster(url) and len(parse_cluster_url(url).seeds) >= 3
    redis_fields = {"encoder": ["redis_url"], "llm": ["kv_l3_url", "media_redis_url", "kv_events_url"],
                    "gateway": ["kv_events_url"]}
    seen = set()
    for _, c, svc in service_containers(objs):
        seen.add(svc)
        for k in [k for k in os.environ if k.startswith("MMSERVE_")]:
            monkeypatch.delenv(k)
        for k, v in container_env(objs, c).items():
            monkeypatch.setenv(k, v)
        s = SETTINGS[svc]()
        assert [getattr(s, f) for f in redis_fields[svc]] == [url] * len(redis_fields[svc]), svc
    assert seen == set(SETTINGS)
