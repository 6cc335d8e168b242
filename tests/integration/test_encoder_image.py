"""Encoder service over real HTTP on loopback: images end to end vs the transformers oracle."""

from __future__ import annotations

import io
import struct
import zlib

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from encoder_svc.app import create_app
from encoder_svc.server import serve_in_thread
from shared.hashing import content_hash
from shared.schemas import EncodeResult
from shared.settings import EncoderSettings
from shared.wire import SAFETENSORS_MIME, unpack

pytestmark = pytest.mark.integration


def image_bytes(fmt: str, seed: int = 0, size: tuple[int, int] = (80, 60), mode: str = "RGB") -> bytes:
    rng = np.random.default_rng(seed)
    w, h = size
    # smooth gradients + noise: JPEG-friendly yet different per seed
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([(xx * 3 + seed * 40) % 256, (yy * 4 + seed * 20) % 256, ((xx + yy) * 2) % 256], -1)
    arr = np.clip(base + rng.integers(-20, 20, base.shape), 0, 255).astype(np.uint8)
    img = Image.fromarray(arr).convert(mode)
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def huge_png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height but whose data is tiny (a decompression bomb)."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def mimo_url(mimo_bundle):
    settings = EncoderSettings(model_dir=str(mimo_bundle), cache_bytes=0, max_image_pixels=1_000_000)
    app = create_app(settings)
    with serve_in_thread(app) as url:
        yield url
        app.state.service.check_integrity()


@pytest.fixture(scope="module")
def gemma3_url(gemma3_bundle):
    app = create_app(EncoderSettings(model_dir=str(gemma3_bundle), cache_bytes=0))
    with serve_in_thread(app) as url:
        yield url
        app.state.service.check_integrity()


@pytest.fixture(scope="module")
def mimo_oracle(mimo_bundle):
    from transformers import AutoImageProcessor, SiglipVisionModel

    from shared.projector import PoolProjector

    d = mimo_bundle / "vision"
    proc = AutoImageProcessor.from_pretrained(d)
    tower = SiglipVisionModel.from_pretrained(d).eval()
    proj = PoolProjector.load(d)

    @torch.no_grad()
    def embed(data: bytes) -> torch.Tensor:
        px = proc(images=Image.open(io.BytesIO(data)), return_tensors="pt")["pixel_values"]
        return proj(tower(pixel_values=px).last_hidden_state)[0]

    return embed


@pytest.fixture(scope="module")
def gemma3_oracle(gemma3_bundle):
    from transformers import AutoImageProcessor, Gemma3ForConditionalGeneration

    proc = AutoImageProcessor.from_pretrained(gemma3_bundle)
    model = Gemma3ForConditionalGeneration.from_pretrained(gemma3_bundle).eval()

    @torch.no_grad()
    def embed(data: bytes) -> torch.Tensor:
        px = proc(images=Image.open(io.BytesIO(data)), return_tensors="pt")["pixel_values"]
        return model.get_image_features(pixel_values=px).pooler_output[0]

    return embed


def encode(url: str, data: bytes, **params) -> httpx.Response:
    params.setdefault("modality", "image")
    return httpx.post(f"{url}/v1/encode", params=params, content=data, timeout=60)


def decode_ok(r: httpx.Response) -> tuple[torch.Tensor, EncodeResult]:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == SAFETENSORS_MIME
    tensors, result = unpack(r.content, EncodeResult)
    return tensors["embeds"], result


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_mimo_image_matches_transformers(mimo_url, mimo_oracle, fmt):
    data = image_bytes(fmt, seed=3)
    embeds, result = decode_ok(encode(mimo_url, data, content_hash=content_hash(data)))
    want = mimo_oracle(data)
    assert embeds.shape == (16, 64) == want.shape
    assert result.num_tokens == 16 and result.hidden_size == 64 and result.modality == "image"
    assert result.content_hash == content_hash(data)
    torch.testing.assert_close(embeds, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_gemma3_image_matches_get_image_features(gemma3_url, gemma3_oracle, fmt):
    data = image_bytes(fmt, seed=5, size=(33, 97))
    embeds, result = decode_ok(encode(gemma3_url, data))
    want = gemma3_oracle(data)
    assert embeds.shape == (16, 64) == want.shape
    torch.testing.assert_close(embeds, want, atol=1e-4, rtol=0)


def test_grayscale_and_rgba_are_converted_like_hf(mimo_url, mimo_oracle):
    for mode in ("L", "RGBA", "P"):
        data = image_bytes("PNG", seed=7, mode=mode)
        embeds, _ = decode_ok(encode(mimo_url, data))
        torch.testing.assert_close(embeds, mimo_oracle(data), atol=1e-4, rtol=0)


def test_different_images_give_different_embeddings(mimo_url):
    a, _ = decode_ok(encode(mimo_url, image_bytes("PNG", seed=1)))
    b, _ = decode_ok(encode(mimo_url, image_bytes("PNG", seed=2)))
    assert (a - b).abs().max() > 1e-3


def _assert_openai_error(r: httpx.Response, status: int, *words: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and set(err) == {"message", "type", "param", "code"}
    for w in words:
        assert w in err["message"].lower(), err["message"]


def test_bad_media_is_a_400_with_a_message(mimo_url):
    _assert_openai_error(encode(mimo_url, b"definitely not an image" * 10), 400, "decode")
    png = image_bytes("PNG", seed=1)
    _assert_openai_error(encode(mimo_url, png[: len(png) // 2]), 400, "corrupt")
    jpeg = image_bytes("JPEG", seed=1)
    _assert_openai_error(encode(mimo_url, jpeg[: len(jpeg) // 2]), 400, "corrupt")
    _assert_openai_error(encode(mimo_url, b""), 400, "empty")
    _assert_openai_error(encode(mimo_url, png, content_hash="0" * 32), 400, "content_hash")


def test_wrong_modality_is_a_400(mimo_url, gemma3_url):
    png = image_bytes("PNG")
    _assert_openai_error(encode(mimo_url, png, modality="pdf"), 400, "modality")
    _assert_openai_error(encode(gemma3_url, png, modality="audio"), 400, "not supported")
    _assert_openai_error(encode(mimo_url, png, fps="-1", modality="video"), 400, "fps")


def test_decompression_bomb_is_refused_before_decoding(mimo_url):
    _assert_openai_error(encode(mimo_url, huge_png_header(50_000, 50_000)), 413, "pixels")
    _assert_openai_error(encode(mimo_url, image_bytes("PNG", size=(1200, 1000))), 413, "1200x1000")


def test_a_bad_request_does_not_break_the_service(mimo_url, mimo_oracle):
    encode(mimo_url, b"junk")
    data = image_bytes("PNG", seed=11)
    embeds, _ = decode_ok(encode(mimo_url, data))
    torch.testing.assert_close(embeds, mimo_oracle(data), atol=1e-4, rtol=0)


def test_health_ready_metrics(mimo_url):
    assert httpx.get(f"{mimo_url}/healthz").json()["status"] == "ok"
    r = httpx.get(f"{mimo_url}/readyz")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert set(r.json()["detail"].split(",")) >= {"image"}
    encode(mimo_url, image_bytes("PNG", seed=12))
    text = httpx.get(f"{mimo_url}/metrics").text
    assert 'encoder_requests_total{modality="image",status="200"}' in text
    assert 'encoder_forward_passes_total{encoder="vision"}' in text


def test_dali_backend_end_to_end(mimo_bundle, mimo_url, mimo_oracle):
    pytest.importorskip("nvidia.dali", reason="nvidia-dali is not installed")
    app = create_app(EncoderSettings(model_dir=str(mimo_bundle), cache_bytes=0, image_backend="dali"))
    with serve_in_thread(app) as url:
        for fmt in ("JPEG", "PNG", "GIF"):
            data = image_bytes(fmt, seed=9, size=(120, 90))
            embeds, _ = decode_ok(encode(url, data))
            want = mimo_oracle(data)
            assert embeds.shape == want.shape
            assert (embeds - want).norm() / want.norm() < 0.02, fmt
        assert encode(url, b"junk" * 10).status_code == 400
        app.state.service.check_integrity()
