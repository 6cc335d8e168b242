"""Where the LLM front read each media item sent by reference is on its /metrics: an item in the
encoders' real Redis tier counts as ``source="redis"`` (no encoder is asked), one only an encoder
holds (over real HTTP) as ``source="http"``; ``mmserve_llm_media_refs_total{outcome}`` counts both
as fetched, as before; on one Redis and on a Redis Cluster."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from encoder_svc.cache.redis_tier import RedisTier
from mmserve.testing.fake_services import ServerThread, fake_encoder_app, filled
from llm_svc.core.media_fetch import EmbeddingFetcher
from llm_svc.front.metrics import LLMMetrics
from llm_svc.types.request import BackendStats, EmbeddingRef
from shared.redis_client import sync_client

pytestmark = pytest.mark.integration
HIDDEN = 8


def samples(metrics: LLMMetrics) -> dict[tuple[str, tuple], float]:
    text = metrics.render(BackendStats()).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_each_fetched_item_is_counted_by_its_source(any_redis_url):
    redis_url = any_redis_url
    prefix = f"mmserve:test:src:{uuid.uuid4().hex[:8]}:"
    in_redis = torch.arange(3 * HIDDEN, dtype=torch.float32).reshape(3, HIDDEN)
    app = fake_encoder_app("e0", hidden=HIDDEN)
    app.state.store["m@1:image:s:http"] = filled(2, HIDDEN, 4.0)
    metrics = LLMMetrics()
    before = samples(metrics)

    async def go(enc: str):
        tier = RedisTier(redis_url, ttl_s=60, max_bytes=1 << 20, prefix=prefix)  # what an encoder writes
        assert await tier.put("m@1:image:s:redis", in_redis)
        await tier.close()
        f = EmbeddingFetcher(HIDDEN, timeout=5, metrics=metrics, redis_url=redis_url, redis_prefix=prefix)
        try:
            return await f.fetch_many({0: EmbeddingRef("m@1:image:s:redis", (enc,), 3),
                                       1: EmbeddingRef("m@1:image:s:http", (enc,), 2)})
        finally:
            await f.close()

    try:
        with ServerThread(app) as enc:
            got = asyncio.run(go(enc.url))
    finally:
        client = sync_client(redis_url)
        for k in client.scan_iter(match=f"{prefix}*"):
            client.delete(k)
        client.close()

    assert torch.equal(got[0], in_redis) and float(got[1][0, 0]) == 4.0
    assert app.state.gets == ["m@1:image:s:http"]  # the Redis item never reached the encoder
    src = "mmserve_llm_media_fetch_source_total"
    assert before[(src, (("source", "redis"),))] == 0 and before[(src, (("source", "http"),))] == 0
    after = samples(metrics)
    assert after[(src, (("source", "redis"),))] == 1
    assert after[(src, (("source", "http"),))] == 1
    assert after[("mmserve_llm_media_refs_total", (("outcome", "fetched"),))] == 2  # the existing series
