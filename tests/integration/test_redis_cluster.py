"""Every Redis user against a real 3-primary Redis Cluster (``redis+cluster://``, the
``redis_cluster`` fixture): the encoders' embedding tier round-trips, spreads over the nodes and
is evicted by TTL and by each node's allkeys-lru as on one Redis; two encoder apps share it; the
LLMs' L3 KV tier stores on one replica and serves another, each conversation on one node and the
conversations on several; KV events of two replicas reach a gateway's index through the
cluster. Every test checks that keys landed on more than one node (or on the node the slot
names), so none of them could pass against a single node."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest
import torch

from encoder_svc.app import create_app as encoder_app
from encoder_svc.cache.redis_tier import RedisTier
from encoder_svc.server import serve_in_thread
from gateway.routing.kv_feed import KVEventFeed
from gateway.routing.kv_index import KVIndex
from llm_svc.front.kv_publish import KVPublisher
from llm_svc.offload.l3 import L3Store, chain_hashes, fingerprint
from llm_svc.types.request import PreparedRequest
from shared.redis_client import sync_client
from shared.schemas import SamplingParams
from shared.settings import EncoderSettings
from tests.integration.test_encoder_cache import encode, forwards, metric, png
from tests.integration.test_kv_tiers import PAGE_TOKENS, W, flush_l3, make_engine
from tests.integration.test_llm_engine import run_to_end

pytestmark = pytest.mark.integration


def spread(by_node: dict[int, list]) -> int:
    """On how many nodes ``keys_by_node`` found keys."""
    return sum(1 for keys in by_node.values() if keys)


def drop(url: str, match: str) -> None:
    r = sync_client(url)
    try:
        for k in r.scan_iter(match=match, count=1000):
            r.delete(k)
    finally:
        r.close()


@pytest.fixture
def prefix(redis_cluster):
    p = f"mmserve:test:enc:{uuid.uuid4().hex[:8]}:"
    yield p
    drop(redis_cluster.url, f"{p}*")


# ------------------------------------------------------------------ encoder embedding tier
def test_embedding_tier_round_trips_and_spreads_over_the_nodes(redis_cluster, prefix):
    values = {f"m@1:image:s:{i}": torch.full((4, 16), float(i)) for i in range(12)}

    async def go():
        tier = RedisTier(redis_cluster.url, ttl_s=60, max_bytes=5000, prefix=prefix)
        try:
            for k, v in values.items():
                assert await tier.put(k, v)
            for k, v in values.items():
                assert torch.equal(await tier.get(k), v), k
            assert not await tier.put("m@1:image:s:big", torch.zeros(64, 64))  # 16 KiB > max_bytes
            assert await tier.get("m@1:image:s:big") is None
            assert await tier.get("m@1:image:s:never") is None
            await tier.remote_integrity()  # its scan walks every primary: all entries, each with a TTL
            by_node = redis_cluster.keys_by_node(f"{prefix}*")
            assert sorted(k.decode() for keys in by_node.values() for k in keys) == \
                sorted(tier.entry_key(k) for k in values)
            assert spread(by_node) >= 2, by_node
            for port, keys in by_node.items():  # each entry on the node owning its hash tag's slot
                assert all(redis_cluster.node_of(k) == port for k in keys)
            await tier.clear()  # every primary's keys go
            assert spread(redis_cluster.keys_by_node(f"{prefix}*")) == 0
            assert tier.available()
        finally:
            await tier.close()

    asyncio.run(go())


def test_embedding_tier_expires_and_is_evicted_per_node_as_on_one_redis(redis_cluster, prefix):
    """TTL: an entry past it is a miss. maxmemory + allkeys-lru on every node: old entries go,
    the newest stay, and a miss for an evicted entry is a miss, not an error."""
    nodes = {p: redis_cluster.node(p) for p in redis_cluster.ports}
    saved = {p: (r.config_get("maxmemory")["maxmemory"], r.config_get("maxmemory-policy")["maxmemory-policy"])
             for p, r in nodes.items()}

    async def go():
        short = RedisTier(redis_cluster.url, ttl_s=1, max_bytes=1 << 20, prefix=prefix + "ttl:")
        tier = RedisTier(redis_cluster.url, ttl_s=600, max_bytes=1 << 20, prefix=prefix)
        try:
            assert await short.put("m@1:image:s:t", torch.ones(2, 2))
            assert await short.get("m@1:image:s:t") is not None
            await asyncio.sleep(2.2)
            assert await short.get("m@1:image:s:t") is None

            for p, r in nodes.items():  # about 1 MiB of room on each node
                r.config_set("maxmemory-policy", "allkeys-lru")
                r.config_set("maxmemory", str(r.info("memory")["used_memory"] + (1 << 20)))
            keys = [f"m@1:image:s:lru{i}" for i in range(90)]  # 90 x 64 KiB: ~2 MiB past room per node
            for k in keys:
                assert await tier.put(k, torch.zeros(128, 128))
            kept = [k for k in keys if await tier.get(k) is not None]
            assert 0 < len(kept) < len(keys) and keys[-1] in kept, len(kept)
            assert keys[0] not in kept  # the least recently used went first
            evicted = {p: int(r.info("stats")["evicted_keys"]) for p, r in nodes.items()}
            assert sum(1 for n in evicted.values() if n > 0) >= 2, evicted  # more than one node evicted
            assert tier.available() and short.available()  # no error on the way
        finally:
            for p, r in nodes.items():
                r.config_set("maxmemory", saved[p][0])
                r.config_set("maxmemory-policy", saved[p][1])
            await tier.clear()
            await tier.close()
            await short.close()

    try:
        asyncio.run(go())
    finally:
        for r in nodes.values():
            r.close()


def test_two_encoder_apps_share_the_cluster_tier(mimo_bundle, redis_cluster, prefix):
    s = EncoderSettings(model_dir=str(mimo_bundle), cache_bytes=0, redis_url=redis_cluster.url, redis_ttl_s=120)
    with serve_in_thread(encoder_app(s, redis_prefix=prefix)) as a, \
            serve_in_thread(encoder_app(s, redis_prefix=prefix)) as b:
        images = [png(40 + i) for i in range(12)]  # all on one of 3 nodes: p = 3 / 3**12
        first = [encode(a, data) for data in images]
        again = [encode(b, data) for data in images]
        for (ea, ra, _), (eb, rb, _) in zip(first, again):
            assert not ra.cached and rb.cached and torch.equal(ea, eb)
        assert forwards(b) == 0
        assert metric(b, "encoder_cache_lookups_total", tier="redis", result="hit") == len(images)
        assert metric(a, "encoder_cache_errors_total", tier="redis") == 0
    by_node = redis_cluster.keys_by_node(f"{prefix}*")
    assert sum(map(len, by_node.values())) == len(images) and spread(by_node) >= 2, by_node


# ------------------------------------------------------------------ LLM L3 KV tier
def conversations(lm, store_key, node_of, n: int = 4) -> list[list[int]]:
    """``n`` 70-token prompts whose first pages' hash tags land on at least two nodes."""
    import random

    out, nodes = [], set()
    for seed in range(200):
        rng = random.Random(1000 + seed)
        ids = [rng.randrange(20, lm.vocab_size) for _ in range(70)]
        out.append(ids)
        nodes.add(node_of(store_key(chain_hashes(ids, PAGE_TOKENS), 1)))
        if len(out) >= n and len(nodes) >= 2:
            return out
    raise AssertionError("no prompts spanning two nodes")


def test_l3_kv_tier_on_a_cluster_serves_another_replica(mimo16, redis_cluster):
    lm = mimo16
    fp = fingerprint({"test": uuid.uuid4().hex})
    url = redis_cluster.url
    try:
        a = make_engine(lm, host=(1000, 300), l3_url=url, fp=fp)
        b = make_engine(lm, host=(1000, 300), l3_url=url, fp=fp)
        ref = make_engine(lm, cache=False)
        store = a.engine.tiers.l3
        convs = conversations(lm, store.page_key, redis_cluster.node_of)

        def prep(rid, prompt):
            return PreparedRequest(request_id=rid, prompt_ids=list(prompt),
                                   sampling=SamplingParams(max_tokens=6, ignore_eos=True))

        for i, ids in enumerate(convs):  # turn 1 of each conversation on replica a
            run_to_end(a, [prep(f"t1-{i}", ids)])
        flush_l3(a)
        for i, ids in enumerate(convs):  # turn 2 on replica b: its prefix comes from L3
            turn2 = ids + [5, 6, 7, 8, 9, 10, 11, 12, 13]
            on_b = run_to_end(b, [prep(f"t2-{i}", turn2)])[f"t2-{i}"]
            assert on_b.tokens == run_to_end(ref, [prep(f"r-{i}", turn2)])[f"r-{i}"].tokens, i
            assert on_b.outs[-1].cached_tokens >= (len(ids) // PAGE_TOKENS) * PAGE_TOKENS, i
        st = b.engine.stats()
        assert st["l3_hits"] == len(convs) and st["l3_ingested_swa"] == W * len(convs), st
        assert st["l3_errors"] == 0 and st["l3_corrupt"] == 0 and a.engine.stats()["l3_errors"] == 0
        b.scheduler.check_integrity()

        by_node = redis_cluster.keys_by_node(f"mmkv:{{{fp}:*")
        assert spread(by_node) >= 2, by_node
        for ids in convs:  # a conversation's pages and windows all on its tag's node
            hashes = chain_hashes(ids, PAGE_TOKENS)
            tag = store.page_key(hashes, 1).split("}")[0] + "}"
            [(port, mine)] = [(p, [k for k in keys if k.decode().startswith(tag)])
                              for p, keys in by_node.items() if any(k.decode().startswith(tag) for k in keys)]
            assert port == redis_cluster.node_of(store.page_key(hashes, 1))
            assert len(mine) >= len(hashes)  # every page (and windows)

        # a touch spanning conversations (slots, nodes): one pipeline, split by node
        keys = [store.page_key(chain_hashes(ids, PAGE_TOKENS), 1) for ids in convs]
        r = sync_client(url)
        for k in keys:
            r.expire(k, 30)
        toucher = L3Store(url, fp, PAGE_TOKENS, W, 1, 1, ttl_s=600)
        toucher.touch(keys)
        toucher.flush()
        assert all(r.ttl(k) > 30 for k in keys), [r.ttl(k) for k in keys]
        assert toucher.stats["l3_touches"] == len(keys) and toucher.stats["l3_errors"] == 0
        toucher.close()
        r.close()
    finally:
        drop(url, f"mmkv:{{{fp}:*")


# ------------------------------------------------------------------ KV events
def test_kv_events_of_two_replicas_reach_a_gateway_index_through_the_cluster(redis_cluster):
    stream = f"test:kv-events:{uuid.uuid4().hex}"
    url = redis_cluster.url

    async def go():
        pubs = [KVPublisher(url, stream, maxlen=1000) for _ in range(2)]
        index = KVIndex()
        async with httpx.AsyncClient() as http:
            # no replica serves a snapshot here: every event from seq 1 is in the stream
            feed = KVEventFeed(url, stream, index, http, lambda: {p.instance: "http://127.0.0.1:9" for p in pubs})
            task = asyncio.create_task(feed.run())
            try:
                for _ in range(200):
                    if feed.connected:
                        break
                    await asyncio.sleep(0.05)
                assert feed.connected
                for p in pubs:
                    p.start()
                pubs[0].apply([1, 2, 3], [])
                pubs[1].apply([10, 20], [])
                pubs[0].apply([4], [2])
                pubs[1].apply([], [10])
                pubs[1].apply([30], [])

                def caught_up() -> bool:
                    return all(index.seq(p.instance) == p.seq for p in pubs)

                for _ in range(200):
                    if caught_up():
                        break
                    await asyncio.sleep(0.05)
                assert caught_up(), [(index.seq(p.instance), p.seq) for p in pubs]
                for p in pubs:
                    assert {k for k in range(64) if index.holds(p.instance, k)} == p.keys, p.instance
                    assert index.live(p.instance) and p.published == p.seq
                assert pubs[0].keys == {1, 3, 4} and pubs[1].keys == {20, 30}
                assert feed.events == 5 and feed.live(pubs[0].instance)
                index.check_integrity()
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                for p in pubs:
                    await p.close()

    asyncio.run(go())
    # the one stream every replica appends to lives on the node owning its slot, only there
    owner = redis_cluster.node_of(stream)
    assert {p for p, keys in redis_cluster.keys_by_node(stream).items() if keys} == {owner}
    drop(url, stream)


# ------------------------------------------------------------------ LLM media fetch
def test_llm_media_fetch_reads_every_item_from_the_cluster_tier(redis_cluster, prefix):
    """Items an encoder stored on the cluster (on several nodes) are read there: the encoder URL
    named in the refs answers nothing, so an item not found in Redis would fail the fetch."""
    from llm_svc.core.media_fetch import EmbeddingFetcher
    from llm_svc.types.request import EmbeddingRef

    hidden = 8
    items = {f"m@1:image:s:f{i}": torch.full((i + 1, hidden), float(i)) for i in range(9)}
    dead = "http://127.0.0.1:9"

    async def go():
        tier = RedisTier(redis_cluster.url, ttl_s=60, max_bytes=1 << 20, prefix=prefix)
        for k, v in items.items():
            assert await tier.put(k, v)
        await tier.close()
        f = EmbeddingFetcher(hidden, timeout=2, redis_url=redis_cluster.url, redis_prefix=prefix)
        try:
            got = await f.fetch_many({i: EmbeddingRef(k, (dead,), v.shape[0]) for i, (k, v) in enumerate(items.items())})
            return got, f.redis_hits, f.gets
        finally:
            await f.close()

    got, hits, gets = asyncio.run(go())
    assert all(torch.equal(got[i], v) for i, v in enumerate(items.values()))
    assert (hits, gets) == (len(items), 0)
    assert spread(redis_cluster.keys_by_node(f"{prefix}*")) >= 2


def test_l3_with_its_cluster_down_at_start_is_an_outage_not_a_crash():
    """A cluster's blocking client connects when it is made: the store makes it on first use,
    inside its error handling, so a cluster unreachable at start-up is an outage like any other."""
    from tests.integration.test_kv_tiers import free_port

    store = L3Store(f"redis+cluster://127.0.0.1:{free_port()}", fingerprint({"t": 1}), PAGE_TOKENS, W, 1, 1,
                    timeout_s=0.2)
    try:
        assert store.lookup(list(range(4 * PAGE_TOKENS)), 0, 0) is None
        assert store.stats["l3_errors"] == 1 and store.stats["l3_up"] == 0 and not store.up
        store.put([("k", b"v")], 1, 0)  # skipped while down
        assert store.stats["l3_skipped"] == 1
    finally:
        store.close()
