"""The encoder app in-process (httpx ASGITransport): readiness, limits, error bodies."""

from __future__ import annotations

import asyncio
import io

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from encoder_svc.app import create_app
from shared.hashing import content_hash
from shared.schemas import EncodeResult
from shared.settings import EncoderSettings
from shared.wire import unpack

pytestmark = pytest.mark.unit


def png() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (30, 40, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def test_not_ready_before_the_model_loads(mimo_bundle):
    app = create_app(EncoderSettings(model_dir=str(mimo_bundle)))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            assert (await c.get("/healthz")).status_code == 200
            r = await c.get("/readyz")
            assert r.status_code == 503 and r.json()["status"] == "loading"
            r = await c.post("/v1/encode", params={"modality": "image"}, content=png())
            assert r.status_code == 503 and "loading" in r.json()["error"]["message"]

    asyncio.run(go())


def test_load_failure_is_reported(tmp_path):
    app = create_app(EncoderSettings(model_dir=str(tmp_path / "missing")))

    async def go():
        with pytest.raises(Exception, match="does not exist"):
            async with app.router.lifespan_context(app):
                pass
        assert "does not exist" in app.state.load_error

    asyncio.run(go())


def test_limits_and_lookup(mimo_bundle):
    app = create_app(EncoderSettings(model_dir=str(mimo_bundle), max_media_bytes=5000, cache_bytes=1 << 20))

    async def go():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                r = await c.post("/v1/encode", params={"modality": "image"}, content=b"x" * 5001)
                assert r.status_code == 413 and "5000 bytes" in r.json()["error"]["message"]

                async def chunked():  # no content-length: refused while streaming
                    for _ in range(10):
                        yield b"x" * 1000

                r = await c.post("/v1/encode", params={"modality": "image"}, content=chunked())
                assert r.status_code == 413 and "limit of 5000 bytes" in r.json()["error"]["message"]
                r = await c.post("/v1/encode", params={"modality": "image", "bogus": "1"}, content=b"x")
                assert r.status_code == 400 and "bogus" in r.json()["error"]["message"]
                data = png()
                assert len(data) <= 5000
                r = await c.post("/v1/encode", params={"modality": "image"}, content=data)
                tensors, res = unpack(r.content, EncodeResult)
                assert r.status_code == 200 and res.num_tokens == tensors["embeds"].shape[0] == 16
                r = await c.get(f"/v1/embeddings/{content_hash(data)}", params={"modality": "audio"})
                assert r.status_code == 404  # same bytes, other modality: another key
                r = await c.get(f"/v1/embeddings/{content_hash(data)}", params={"modality": "image"})
                assert r.status_code == 200
            app.state.service.check_integrity()

    asyncio.run(go())


def test_identical_concurrent_requests_share_one_encode(mimo_bundle):
    """Single flight: six identical requests started together run one forward on one item;
    an undecodable body shared by three requests fails all three with the same 400."""
    from encoder_svc.errors import BadMedia
    from shared.schemas import EncodeParams

    app = create_app(EncoderSettings(model_dir=str(mimo_bundle), cache_bytes=0))

    async def go():
        async with app.router.lifespan_context(app):
            svc = app.state.service
            params = EncodeParams(modality="image")
            outs = await asyncio.gather(*(svc.encode(params, png()) for _ in range(6)))
            reg = app.state.metrics.registry
            assert reg.get_sample_value("encoder_forward_items_total", {"encoder": "vision"}) == 1
            assert sorted(r.cached for _, r in outs) == [False] + [True] * 5
            assert all(e is outs[0][0] for e, _ in outs)
            bad = await asyncio.gather(*(svc.encode(params, b"junk" * 10) for _ in range(3)), return_exceptions=True)
            assert all(isinstance(e, BadMedia) for e in bad)
            svc.check_integrity()
            assert not svc._inflight

    asyncio.run(go())


def test_bfloat16_weights_give_close_embeddings(mimo_bundle):
    from shared.schemas import EncodeParams

    async def embed(dtype: str):
        app = create_app(EncoderSettings(model_dir=str(mimo_bundle), cache_bytes=0, dtype=dtype))
        async with app.router.lifespan_context(app):
            return (await app.state.service.encode(EncodeParams(modality="image"), png()))[0]

    full, half = asyncio.run(embed("float32")), asyncio.run(embed("bfloat16"))
    assert full.dtype == torch.float32 and half.dtype == torch.bfloat16 and half.shape == full.shape
    rel = (half.float() - full).norm() / full.norm()
    assert rel < 0.05, rel


def test_failed_forward_and_unexpected_errors_are_json_500s(mimo_bundle, monkeypatch):
    app = create_app(EncoderSettings(model_dir=str(mimo_bundle), cache_bytes=0, max_wait_ms=200))

    class Broken(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("device lost")

    async def go():
        async with app.router.lifespan_context(app):
            svc = app.state.service
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                real = svc.ctx.models.vision
                svc.ctx.models.vision = Broken()
                rs = await asyncio.gather(*(c.post("/v1/encode", params={"modality": "image"}, content=png()) for _ in range(3)))
                assert [r.status_code for r in rs] == [500] * 3
                assert all("device lost" in r.json()["error"]["message"] for r in rs)
                svc.ctx.models.vision = real
                assert (await c.post("/v1/encode", params={"modality": "image"}, content=png())).status_code == 200

                import encoder_svc.modalities.image as image_mod

                def boom(*a, **k):
                    raise KeyError("surprise")

                monkeypatch.setattr(image_mod, "encode", boom)
                r = await c.post("/v1/encode", params={"modality": "image"}, content=png())
                msg = r.json()["error"]["message"]  # the type, never the internals of our bug
                assert r.status_code == 500 and "KeyError" in msg and "surprise" not in msg
            svc.check_integrity()

    asyncio.run(go())
