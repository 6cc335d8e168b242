"""The LLM front's ``EmbeddingFetcher`` against encoders over real HTTP (the gateway's fake
encoder, which keeps what it encoded by reference): single flight per key, sources tried in
order, and a clear ``MediaUnavailable`` when none has the item or what comes back is wrong."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from mmserve.testing.fake_services import ServerThread, fake_encoder_app, filled, free_port_url
from llm_svc.core.media_fetch import EmbeddingFetcher, MediaUnavailable
from llm_svc.types.request import EmbeddingRef

pytestmark = pytest.mark.integration
HIDDEN = 8


@pytest.fixture
def encoder():
    app = fake_encoder_app("e0", hidden=HIDDEN)
    with ServerThread(app) as srv:
        srv.app = app
        yield srv


def test_concurrent_fetches_of_one_key_make_one_request(encoder):
    encoder.app.state.store["k:image:s:1"] = filled(4, HIDDEN, 7.0)

    async def go():
        f = EmbeddingFetcher(HIDDEN, timeout=5)
        ref = EmbeddingRef("k:image:s:1", (encoder.url,), 4)
        got = await asyncio.gather(*(f.fetch(ref) for _ in range(6)))
        f.check_integrity()
        await f.close()
        return got

    got = asyncio.run(go())
    assert all(t.shape == (4, HIDDEN) and float(t[0, 0]) == 7.0 for t in got)
    assert encoder.app.state.gets == ["k:image:s:1"]


def test_sources_are_tried_in_order_and_a_miss_everywhere_is_unavailable(encoder):
    encoder.app.state.store["k:image:s:2"] = filled(2, HIDDEN, 1.0)

    async def go():
        f = EmbeddingFetcher(HIDDEN, timeout=5)
        dead = free_port_url()
        t = await f.fetch(EmbeddingRef("k:image:s:2", (dead, encoder.url), 2))
        with pytest.raises(MediaUnavailable, match="HTTP 404"):
            await f.fetch(EmbeddingRef("k:image:s:gone", (encoder.url,), 2))
        with pytest.raises(MediaUnavailable, match=r"need \[3, 8\]"):  # wrong length: a bad answer is a miss
            await f.fetch(EmbeddingRef("k:image:s:2", (encoder.url,), 3))
        await f.close()
        return t

    assert float(asyncio.run(go())[1, 0]) == 1.0


def test_wrong_hidden_size_is_refused(encoder):
    encoder.app.state.store["k:image:s:3"] = filled(2, HIDDEN + 1, 1.0)

    async def go():
        f = EmbeddingFetcher(HIDDEN, timeout=5)
        try:
            await f.fetch(EmbeddingRef("k:image:s:3", (encoder.url,), 2))
        finally:
            await f.close()

    with pytest.raises(MediaUnavailable, match="need"):
        asyncio.run(go())
    assert httpx.get(encoder.url + "/healthz").status_code == 200


def test_the_encoders_redis_tier_is_read_first(redis_url):
    import uuid

    import redis as sync_redis
    import torch

    from encoder_svc.cache.redis_tier import RedisTier

    prefix = f"mmserve:test:ref:{uuid.uuid4().hex[:8]}:"
    emb = torch.arange(3 * HIDDEN, dtype=torch.float32).reshape(3, HIDDEN)

    async def go():
        tier = RedisTier(redis_url, ttl_s=60, max_bytes=1 << 20, prefix=prefix)  # what an encoder writes
        assert await tier.put("m@1:image:s:9", emb)
        await tier.close()
        f = EmbeddingFetcher(HIDDEN, timeout=5, redis_url=redis_url, redis_prefix=prefix)
        dead = free_port_url()  # no encoder is up: Redis alone serves it
        t = await f.fetch(EmbeddingRef("m@1:image:s:9", (dead,), 3))
        with pytest.raises(MediaUnavailable, match="redis: no entry"):
            await f.fetch(EmbeddingRef("m@1:image:s:other", (dead,), 3))
        hits = f.redis_hits
        await f.close()
        return t, hits

    try:
        t, hits = asyncio.run(go())
    finally:
        client = sync_redis.Redis.from_url(redis_url)
        for k in client.scan_iter(match=f"{prefix}*"):
            client.delete(k)
        client.close()
    assert torch.equal(t, emb) and hits == 1


def test_sources_outside_the_allow_list_are_never_contacted(encoder):
    encoder.app.state.store["k:image:s:9"] = filled(3, HIDDEN, 5.0)
    ref = EmbeddingRef("k:image:s:9", ("http://169.254.169.254/latest", encoder.url), 3)

    async def go(allow):
        f = EmbeddingFetcher(HIDDEN, timeout=5, allow=allow)
        try:
            return await f.fetch(ref), f.gets
        finally:
            await f.close()

    with pytest.raises(MediaUnavailable, match="MEDIA_FETCH_ALLOW"):
        asyncio.run(go(["10.0.0.0/8", "encoder"]))
    t, gets = asyncio.run(go(["127.0.0.1"]))  # the metadata address is skipped, the encoder asked
    assert gets == 1 and t.shape == (3, HIDDEN) and float(t[0, 0]) == 5.0
