"""``mmserve up --redis-url`` (issue 11): the launcher gives the URL to the encoders (their Redis
embedding tier) and to the LLMs (L3 KV tier, and ``--media-redis-url``), so with media sent by
reference (the gateway's default) the LLM reads an image's embeddings from Redis, written there
by the encoder, and never asks the encoder for them (``GET /v1/embeddings/{key}``).

The stack runs on the real Redis in a database of its own (``DB``): the encoders' key prefix is
not a setting, and this module's L3 pages must not meet other tests' (same tiny model, same
prompts). What the stack wrote there is deleted once it stopped."""

from __future__ import annotations

import uuid

import httpx
import pytest
import redis as sync_redis

from benchmarks._stack_util import image_part, make_png, scrape, total, user
from shared.embedding_store import DEFAULT_PREFIX
from mmserve.launcher import LocalStack, StackSpec
from tests.conftest import REDIS_HOST, REDIS_PORT

pytestmark = pytest.mark.e2e
DB = 7  # no other test uses it


@pytest.fixture(scope="module")
def redis_db(redis_url):  # redis_url: fails clearly when Redis is down
    url = f"redis://{REDIS_HOST}:{REDIS_PORT}/{DB}"
    client = sync_redis.Redis.from_url(url)
    before = set(client.scan_iter(count=1000))
    yield url, client
    for k in set(client.scan_iter(count=1000)) - before:  # after the stack stopped: nothing writes now
        client.delete(k)
    client.close()


@pytest.fixture(scope="module")
def stack(mimo_bundle, redis_db, tmp_path_factory):
    spec = StackSpec(model_dir=str(mimo_bundle), gateway_port=0, redis_url=redis_db[0])
    with LocalStack(spec, log_dir=tmp_path_factory.mktemp("up-redis-logs")) as s:
        s.wait_ready(timeout=240)
        yield s


def test_the_llm_reads_media_sent_by_reference_from_the_encoders_redis(stack, redis_db):
    client = redis_db[1]
    enc, llm = stack.encoders[0].url, stack.llms[0].url
    src = "mmserve_llm_media_fetch_source_total"
    seed = uuid.uuid4().int % 10_000  # an image no earlier run left in Redis
    body = {"model": stack.model_name, "max_tokens": 4, "temperature": 0,
            "messages": [user("What is in this image?", image_part(make_png(seed=seed)))]}

    r = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=180)

    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] is not None
    # the encoder stored the embeddings in Redis (its --redis-url) ...
    assert any(True for _ in client.scan_iter(match=f"{DEFAULT_PREFIX}e:*", count=1000))
    # ... and the LLM read them there (its --media-redis-url), not from the encoder
    m = scrape(llm)
    assert total(m, "mmserve_llm_media_refs_total", outcome="fetched") == 1
    by_source = {s: total(m, src, source=s) for s in ("redis", "http")}
    assert by_source == {"redis": 1, "http": 0}, f"not read from Redis (does it get --media-redis-url?): {by_source}"
    # the encoder was never asked for them: no lookup by key hit its cache, no such request logged
    assert total(scrape(enc), "encoder_cache_lookups_total", result="hit") == 0
    log = stack.encoders[0].log_tail(1 << 20)
    assert "POST /v1/encode" in log  # its access log is on: a GET by key would be there
    assert "/v1/embeddings/" not in log
