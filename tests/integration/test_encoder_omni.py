"""The encoder service on a MiMo-V2.5 omni directory over real HTTP: size-dependent image token
counts, timestamped video segments, cross-request batching, the cache (segments included) and
startup refusals of wrong checkpoints (file + field / tensor named)."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import httpx
import pytest
import torch

from encoder_svc.app import create_app
from encoder_svc.models.loader import load_models
from encoder_svc.preprocess.image_decode import decode_rgb
from encoder_svc.server import serve_in_thread
from encoder_svc.video.backends import VIDEO_BACKENDS
from shared.bundle import CheckpointError, load_bundle_spec
from shared.schemas import EncodeResult
from shared.settings import EncoderSettings
from mmserve.tiny.mimo_omni import write_mimo_omni
from shared.wire import unpack
from tests.integration.test_encoder_image import image_bytes

pytestmark = pytest.mark.integration
SIZES = {(150, 100): (3, 5), (200, 300): (9, 6), (30, 20): (2, 3)}  # (w, h) -> merged grid (lh, lw); the last upscaled


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory) -> Path:
    return write_mimo_omni(tmp_path_factory.mktemp("omni-enc") / "m")


@pytest.fixture(scope="module")
def video(tmp_path_factory) -> bytes:
    p = tmp_path_factory.mktemp("omni-media") / "v.mp4"
    subprocess.run(["ffmpeg", "-loglevel", "error", "-y", "-f", "lavfi", "-i", "testsrc=size=160x120:rate=30", "-t", "3",
                    "-c:v", "libx264", "-pix_fmt", "yuv420p", str(p)], check=True)
    return p.read_bytes()


@pytest.fixture(scope="module")
def served(omni_dir):
    s = EncoderSettings(model_dir=str(omni_dir), cache_bytes=64 << 20, video_max_frames=5, video_fps=2.0,
                        max_wait_ms=200.0)
    app = create_app(s)
    with serve_in_thread(app) as url:
        yield url, app
        app.state.service.check_integrity()
        assert app.state.service.ctx.batcher.pending() == 0


@pytest.fixture(scope="module")
def models(omni_dir):
    return load_models(load_bundle_spec(omni_dir))


def encode(url: str, data: bytes, **params):
    r = httpx.post(f"{url}/v1/encode", params=params, content=data, timeout=120)
    assert r.status_code == 200, r.text
    tensors, result = unpack(r.content, EncodeResult)
    return tensors["embeds"], result, r.headers.get("x-mmserve-cache-key")


@pytest.mark.parametrize("size", list(SIZES))
def test_image_tokens_follow_its_size(served, models, size):
    url, _ = served
    data = image_bytes("PNG", seed=1, size=size)
    e, res, _ = encode(url, data, modality="image")
    lh, lw = SIZES[size]
    assert res.num_tokens == lh * lw == e.shape[0] and e.shape[1] == 128 and res.segments is None
    want = models.vision(models.vision.preprocess.image(decode_rgb(data, 10**8)))[0]
    torch.testing.assert_close(e, want, atol=1e-5, rtol=0)


def test_extreme_aspect_ratio_is_a_clear_400(served):
    url, _ = served
    r = httpx.post(f"{url}/v1/encode", params={"modality": "image"}, content=image_bytes("PNG", size=(9000, 40)), timeout=60)
    assert r.status_code == 400 and "aspect ratio" in r.json()["error"]["message"], r.text


def test_concurrent_images_share_forwards(served, models):
    """Same-size images of different requests fuse into one forward (the grid is part of the
    batch key); each still gets its own rows."""
    url, app = served
    blobs = [image_bytes("PNG", seed=10 + i, size=(150, 100)) for i in range(4)] + [image_bytes("PNG", seed=20, size=(30, 20))]
    forwards = app.state.metrics.forwards.labels("vision")
    before = forwards._value.get()

    async def go():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(c.post(f"{url}/v1/encode", params={"modality": "image"}, content=b)
                                          for b in blobs))

    rs = asyncio.run(go())
    assert all(r.status_code == 200 for r in rs)
    assert forwards._value.get() - before < len(blobs)  # at least two images shared a forward
    for r, b in zip(rs, blobs):
        e = unpack(r.content, EncodeResult)[0]["embeds"]
        want = models.vision(models.vision.preprocess.image(decode_rgb(b, 10**8)))[0]
        torch.testing.assert_close(e, want, atol=1e-5, rtol=0)


def test_video_groups_frames_in_pairs_with_timestamps(served, models, video):
    url, _ = served
    e, res, key = encode(url, video, modality="video")
    # 90 frames at 30 fps, 2 fps capped at 5 -> indices 0, 18, 36, 54, 72 -> groups (0,18) (36,54) (72,72)
    # frames 120x160 within video_max_pixels(5 frames) = 16384 -> 96x128 -> 3x4 merged tokens per group
    assert [(g.start_s, g.num_tokens) for g in res.segments] == [(0.0, 12), (1.2, 12), (2.4, 12)]
    assert res.num_tokens == 36 == e.shape[0]
    frames = VIDEO_BACKENDS.get("decord")(video).frames([0, 18, 36, 54, 72, 72])
    pre = models.vision.preprocess
    want = models.vision(pre.video(frames, pre.video_size(120, 160, 5))).reshape(-1, 128)
    torch.testing.assert_close(e, want, atol=1e-5, rtol=0)
    # the cache key carries the preprocessing: another frame rate is another entry, a repeat hits
    _, again, _ = encode(url, video, modality="video")
    assert again.cached and again.segments == res.segments
    e3, other, _ = encode(url, video, modality="video", fps=1.0)
    assert not other.cached and len(other.segments) == 2  # 3 frames -> 2 groups
    r = httpx.get(f"{url}/v1/embeddings/{key}", timeout=30)
    assert r.status_code == 200
    _, by_key = unpack(r.content, EncodeResult)
    assert by_key.segments == res.segments and by_key.num_tokens == 36


def _load(d: Path):
    return load_models(load_bundle_spec(d))


def test_missing_vit_tensor_fails_at_startup(tmp_path):
    d = write_mimo_omni(tmp_path / "m", drop_tensors=("visual.blocks.2.attn.sinks",))
    with pytest.raises(CheckpointError, match=r"m/model.safetensors: tensor 'visual.blocks.2.attn.sinks' is missing"):
        _load(d)


def test_unknown_vision_config_key_fails_at_startup(tmp_path):
    d = write_mimo_omni(tmp_path / "m", vision_extra={"use_deformable_patches": True})
    with pytest.raises(CheckpointError, match=r"m/config.json: field 'vision_config.use_deformable_patches'"):
        _load(d)


def test_shape_mismatch_fails_at_startup(tmp_path):
    d = write_mimo_omni(tmp_path / "m", vision_extra={"intermediate_size": 96})  # file has 128
    with pytest.raises(CheckpointError, match=r"m/model.safetensors: tensor 'visual.blocks.0.mlp.gate_proj.weight' "
                                              r"has shape \[128, 64\]; config.json's vision_config needs \[96, 64\]"):
        _load(d)


def test_unknown_processor_config_key_fails_at_startup(tmp_path):
    import json

    d = write_mimo_omni(tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["processor_config"]["do_center_crop"] = True  # would change pixels: refused, never ignored
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"m/config.json: field 'processor_config.do_center_crop'"):
        _load(d)
