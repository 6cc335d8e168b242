"""Cross-request batching over real HTTP: concurrent requests fused into few forwards,
each getting exactly the embeddings it gets alone."""

from __future__ import annotations

import asyncio
import io

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from encoder_svc.app import create_app
from encoder_svc.server import serve_in_thread
from shared.schemas import EncodeResult
from shared.settings import EncoderSettings
from shared.wire import unpack

pytestmark = pytest.mark.integration


def png(seed: int, size=(70, 50)) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def metric(url: str, name: str, **labels) -> float:
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


@pytest.fixture(scope="module")
def batched_url(mimo_bundle):
    s = EncoderSettings(model_dir=str(mimo_bundle), cache_bytes=0, max_batch_size=16, max_wait_ms=1000)
    app = create_app(s)
    with serve_in_thread(app) as url:
        yield url
        app.state.service.check_integrity()
        assert app.state.service.ctx.batcher.pending() == 0


@pytest.fixture(scope="module")
def unbatched_url(mimo_bundle):
    s = EncoderSettings(model_dir=str(mimo_bundle), cache_bytes=0, max_batch_size=1, max_wait_ms=0)
    with serve_in_thread(create_app(s)) as url:
        yield url


async def _post_all(url: str, bodies: list[bytes], modality="image") -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=120) as c:
        return await asyncio.gather(
            *(c.post(f"{url}/v1/encode", params={"modality": modality}, content=b) for b in bodies)
        )


def test_concurrent_requests_are_fused_and_split_back(batched_url, unbatched_url):
    bodies = [png(i) for i in range(12)]
    alone = [unpack(r.content, EncodeResult)[0]["embeds"] for r in asyncio.run(_post_all(unbatched_url, bodies))]
    before = metric(batched_url, "encoder_forward_passes_total", encoder="vision")
    responses = asyncio.run(_post_all(batched_url, bodies))
    passes = metric(batched_url, "encoder_forward_passes_total", encoder="vision") - before
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    for r, want in zip(responses, alone):
        torch.testing.assert_close(unpack(r.content, EncodeResult)[0]["embeds"], want, atol=1e-5, rtol=0)
    assert len({t.sum().item() for t in alone}) == 12  # the images really differ
    assert 1 <= passes <= 6, passes  # 12 concurrent requests: a few fused forwards, not 12
    assert metric(batched_url, "encoder_batch_size_sum", encoder="vision") >= 12


def test_a_bad_item_fails_only_its_own_request(batched_url):
    bodies = [png(20), b"not an image at all", png(21), png(22)[:100]]
    codes = [r.status_code for r in asyncio.run(_post_all(batched_url, bodies))]
    assert codes == [200, 400, 200, 400]


def test_unbatched_runs_one_forward_per_image(unbatched_url):
    before = metric(unbatched_url, "encoder_forward_passes_total", encoder="vision")
    asyncio.run(_post_all(unbatched_url, [png(i) for i in range(30, 35)]))
    assert metric(unbatched_url, "encoder_forward_passes_total", encoder="vision") - before == 5

