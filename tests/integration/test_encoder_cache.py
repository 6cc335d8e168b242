"""Embedding cache end to end: hits skip the forward, tiers shared between app instances,
Redis TTL/budget, and Redis outages (dead port, server killed mid-test) degrading to local."""

from __future__ import annotations

import asyncio
import io
import logging
import shutil
import subprocess
import time
import uuid

import httpx
import numpy as np
import pytest
import redis
import torch
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from encoder_svc.app import create_app
from encoder_svc.cache.redis_tier import RedisTier
from encoder_svc.server import free_port, serve_in_thread
from shared.hashing import content_hash
from shared.schemas import EncodeResult
from shared.settings import EncoderSettings
from shared.wire import unpack

pytestmark = pytest.mark.integration


def png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (40, 50, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def metric(url: str, name: str, **labels) -> float:
    total = 0.0
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def forwards(url: str) -> float:
    return metric(url, "encoder_forward_passes_total")


def encode(url: str, data: bytes, **params) -> tuple[torch.Tensor, EncodeResult, httpx.Response]:
    params.setdefault("modality", "image")
    r = httpx.post(f"{url}/v1/encode", params=params, content=data, timeout=60)
    assert r.status_code == 200, r.text
    t, res = unpack(r.content, EncodeResult)
    return t["embeds"], res, r


@pytest.fixture
def prefix(redis_url):
    p = f"mmserve:test:enc:{uuid.uuid4().hex[:8]}:"
    yield p
    client = redis.Redis.from_url(redis_url)
    for k in client.scan_iter(match=f"{p}*"):
        client.delete(k)
    client.close()


def test_memory_hit_runs_no_forward_and_get_endpoint(mimo_bundle):
    s = EncoderSettings(model_dir=str(mimo_bundle), cache_bytes=1 << 20)
    app = create_app(s)
    with serve_in_thread(app) as url:
        data = png(1)
        e1, r1, resp = encode(url, data)
        f1 = forwards(url)
        e2, r2, _ = encode(url, data)
        assert (r1.cached, r2.cached) == (False, True)
        assert forwards(url) == f1 == 1
        assert torch.equal(e1, e2)
        assert metric(url, "encoder_cache_lookups_total", tier="memory", modality="image", result="hit") == 1
        assert metric(url, "encoder_cache_bytes", tier="memory") == e1.numel() * 4

        g = httpx.get(f"{url}/v1/embeddings/{content_hash(data)}", params={"modality": "image"})
        assert g.status_code == 200 and torch.equal(unpack(g.content, EncodeResult)[0]["embeds"], e1)
        key = resp.headers["x-mmserve-cache-key"]
        assert unpack(resp.content, EncodeResult)[1].key == key  # the media key travels in the result too
        assert key.endswith(content_hash(data)) and key.startswith(app.state.service.ctx.models.model_id)
        g2 = httpx.get(f"{url}/v1/embeddings/{key}")
        assert g2.status_code == 200 and unpack(g2.content, EncodeResult)[1].cached
        assert httpx.get(f"{url}/v1/embeddings/{'0' * 32}", params={"modality": "image"}).status_code == 404
        assert forwards(url) == 1
        app.state.service.check_integrity()


def test_video_params_are_part_of_the_key(mimo_bundle, tmp_path):
    subprocess.run(["ffmpeg", "-loglevel", "error", "-y", "-f", "lavfi", "-i", "testsrc=size=96x64:rate=10",
                    "-t", "2", "-c:v", "libx264", "-pix_fmt", "yuv420p", str(tmp_path / "v.mp4")], check=True)
    data = (tmp_path / "v.mp4").read_bytes()
    s = EncoderSettings(model_dir=str(mimo_bundle), cache_bytes=1 << 20)
    with serve_in_thread(create_app(s)) as url:
        a, ra, _ = encode(url, data, modality="video", fps=1)
        b, rb, _ = encode(url, data, modality="video", fps=4)
        c, rc, _ = encode(url, data, modality="video", fps=1)
        assert (ra.cached, rb.cached, rc.cached) == (False, False, True)
        assert a.shape == (16, 64) and b.shape == (64, 64) and torch.equal(a, c)


def test_shm_tier_shared_between_two_apps(mimo_bundle, tmp_path):
    s = EncoderSettings(model_dir=str(mimo_bundle), cache_bytes=0, shm_cache_bytes=1 << 20)
    d = str(tmp_path / "shm")
    with serve_in_thread(create_app(s, shm_dir=d)) as a, serve_in_thread(create_app(s, shm_dir=d)) as b:
        data = png(2)
        ea, ra, _ = encode(a, data)
        eb, rb, _ = encode(b, data)
        assert not ra.cached and rb.cached and torch.equal(ea, eb)
        assert forwards(b) == 0


def test_redis_shared_between_two_apps_with_ttl(mimo_bundle, redis_url, prefix):
    s = EncoderSettings(model_dir=str(mimo_bundle), cache_bytes=0, redis_url=redis_url, redis_ttl_s=120)
    with serve_in_thread(create_app(s, redis_prefix=prefix)) as a, serve_in_thread(create_app(s, redis_prefix=prefix)) as b:
        data = png(3)
        ea, ra, resp = encode(a, data)
        eb, rb, _ = encode(b, data)
        assert not ra.cached and rb.cached and torch.equal(ea, eb)
        assert forwards(b) == 0 and forwards(a) == 1
        assert metric(b, "encoder_cache_lookups_total", tier="redis", result="hit") == 1
        client = redis.Redis.from_url(redis_url)
        keys = [k.decode() for k in client.scan_iter(match=f"{prefix}*")]
        assert keys == [f"{prefix}e:{{{resp.headers['x-mmserve-cache-key']}}}"]  # one key per entry, no bookkeeping
        assert 0 < client.ttl(keys[0]) <= 120
        client.close()


def test_redis_entries_are_single_keys_redis_evicts(redis_url, prefix):
    """No Lua, no LRU bookkeeping: one key per entry with a TTL (Redis's allkeys-lru evicts
    them); an entry over max_bytes is not stored."""
    async def go():
        value = torch.zeros(16, 64)
        tier = RedisTier(redis_url, ttl_s=60, max_bytes=5000, prefix=prefix)
        try:
            for i in range(3):
                await tier.put(f"m@1:image:s:{i}", value)
            assert all([await tier.get(f"m@1:image:s:{i}") is not None for i in range(3)])
            await tier.put("m@1:image:s:big", torch.zeros(64, 64))  # 16 KiB > max_bytes
            assert await tier.get("m@1:image:s:big") is None
            assert tier.entry_key("m@1:image:s:0") == f"{prefix}e:{{m@1:image:s:0}}"
            await tier.remote_integrity()
        finally:
            await tier.clear()
            await tier.close()

    asyncio.run(go())


def test_dead_redis_degrades_to_local_cache(mimo_bundle, caplog):
    s = EncoderSettings(model_dir=str(mimo_bundle), cache_bytes=1 << 20, redis_url=f"redis://127.0.0.1:{free_port()}/0")
    caplog.set_level(logging.WARNING, logger="encoder_svc.cache.redis_tier")
    with serve_in_thread(create_app(s)) as url:
        data = png(4)
        _, r1, _ = encode(url, data)
        _, r2, _ = encode(url, data)
        assert (r1.cached, r2.cached) == (False, True)  # served from the memory tier
        assert metric(url, "encoder_cache_errors_total", tier="redis") >= 1
    assert any("redis cache" in rec.message for rec in caplog.records)


@pytest.fixture
def own_redis():
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    yield proc, f"redis://127.0.0.1:{port}/0"
    client.close()
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def test_redis_going_away_mid_test(mimo_bundle, own_redis):
    proc, url_redis = own_redis
    s = EncoderSettings(model_dir=str(mimo_bundle), cache_bytes=1 << 20, redis_url=url_redis)
    with serve_in_thread(create_app(s)) as a, serve_in_thread(create_app(s)) as b:
        data = png(5)
        encode(a, data)
        _, rb, _ = encode(b, data)
        assert rb.cached  # via Redis
        proc.kill()
        proc.wait(10)
        other = png(6)
        _, r1, _ = encode(b, other)  # Redis is gone: a miss, encoded, still 200
        _, r2, _ = encode(b, other)
        assert (r1.cached, r2.cached) == (False, True)  # local caching goes on
        _, r3, _ = encode(a, png(7))
        assert not r3.cached
        assert metric(b, "encoder_cache_errors_total", tier="redis") >= 1
