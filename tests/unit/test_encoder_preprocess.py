"""Image preprocessing backends vs the HF image processors; decode guards; audio features."""

from __future__ import annotations

import io
import math
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from encoder_svc.errors import BadMedia, MediaTooLarge
from encoder_svc.preprocess.image import IMAGE_BACKENDS, TorchvisionImageBackend, make_image_backend
from encoder_svc.preprocess.image_config import ImagePreprocessConfig
from encoder_svc.preprocess.image_decode import decode_rgb

pytestmark = pytest.mark.unit


def pattern(w: int, h: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([(xx * 3 + seed) % 256, (yy * 4) % 256, ((xx + yy) * 2) % 256], -1)
    return np.clip(base + rng.integers(-20, 20, base.shape), 0, 255).astype(np.uint8)


def encoded(arr: np.ndarray, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt, **kw)
    return buf.getvalue()


@pytest.fixture(scope="module", params=["mimo", "gemma3"])
def processor_dir(request, mimo_bundle, gemma3_bundle):
    return mimo_bundle / "vision" if request.param == "mimo" else gemma3_bundle


SIZES = [(80, 60), (640, 480), (33, 97), (64, 64), (1, 1)]


def test_config_reads_both_processors(mimo_bundle, gemma3_bundle):
    s = ImagePreprocessConfig.from_json(mimo_bundle / "vision" / "preprocessor_config.json")
    g = ImagePreprocessConfig.from_json(gemma3_bundle / "preprocessor_config.json")
    assert (s.height, s.width, s.resample) == (64, 64, 3)  # SigLIP: bicubic
    assert (g.height, g.width, g.resample) == (64, 64, 2)  # Gemma 3: bilinear
    assert s.signature() != g.signature()


@pytest.mark.parametrize("size", SIZES)
def test_torchvision_backend_equals_hf_processor(processor_dir, size):
    from transformers import AutoImageProcessor

    cfg = ImagePreprocessConfig.from_json(processor_dir / "preprocessor_config.json")
    backend = TorchvisionImageBackend(cfg, torch.device("cpu"), 10**8)
    hf = AutoImageProcessor.from_pretrained(processor_dir)
    data = encoded(pattern(*size), "PNG")
    ours = backend.images([data])
    ref = hf(images=Image.open(io.BytesIO(data)), return_tensors="pt")["pixel_values"]
    assert ours.shape == ref.shape == (1, 3, 64, 64) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("size", SIZES[:4])
def test_torchvision_backend_close_to_hf_pil_processor(mimo_bundle, size):
    """PIL's resampling differs from torchvision's antialiased kernels by a few uint8 levels.
    Measured on these patterns: max |diff| 0.047 (6/255 after normalize), mean 0.002."""
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    d = mimo_bundle / "vision"
    backend = TorchvisionImageBackend(ImagePreprocessConfig.from_json(d / "preprocessor_config.json"), "cpu", 10**8)
    data = encoded(pattern(*size, seed=2), "PNG")
    ours = backend.images([data])
    ref = SiglipImageProcessorPil.from_pretrained(d)(images=Image.open(io.BytesIO(data)), return_tensors="pt")["pixel_values"]
    diff = (ours - torch.as_tensor(ref)).abs()
    assert diff.max() <= 0.06 and diff.mean() <= 0.005, (diff.max(), diff.mean())


def test_batched_images_equal_single(mimo_bundle):
    cfg = ImagePreprocessConfig.from_json(mimo_bundle / "vision" / "preprocessor_config.json")
    backend = TorchvisionImageBackend(cfg, "cpu", 10**8)
    blobs = [encoded(pattern(w, h, s), "PNG") for s, (w, h) in enumerate([(80, 60), (80, 60), (30, 50)])]
    batch = backend.images(blobs)
    for i, b in enumerate(blobs):
        torch.testing.assert_close(batch[i], backend.images([b])[0])


def test_frames_path_equals_image_path(mimo_bundle):
    cfg = ImagePreprocessConfig.from_json(mimo_bundle / "vision" / "preprocessor_config.json")
    backend = TorchvisionImageBackend(cfg, "cpu", 10**8)
    arr = pattern(120, 90, 4)
    frames = torch.from_numpy(arr).permute(2, 0, 1)[None]
    torch.testing.assert_close(backend.frames(frames), backend.images([encoded(arr, "PNG")]))


def test_gif_and_animated_webp_use_the_first_frame():
    frames = [pattern(40, 30, s) for s in range(3)]
    imgs = [Image.fromarray(f) for f in frames]
    for fmt, kw in (("GIF", {}), ("WEBP", {"lossless": True})):
        buf = io.BytesIO()
        imgs[0].save(buf, format=fmt, save_all=True, append_images=imgs[1:], **kw)
        got = decode_rgb(buf.getvalue(), 10**6)
        want = torch.from_numpy(np.array(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))).permute(2, 0, 1)
        assert got.shape == (3, 30, 40)
        assert torch.equal(got, want)
        if fmt == "WEBP":  # lossless: the first frame exactly, not the second
            assert torch.equal(got, torch.from_numpy(frames[0]).permute(2, 0, 1))


def _png_claiming(width: int, height: int) -> bytes:
    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


def test_bomb_guard_uses_the_header():
    with pytest.raises(MediaTooLarge, match="pixels"):
        decode_rgb(_png_claiming(100_000, 100_000), 64_000_000)
    with pytest.raises(MediaTooLarge, match="limit is 100"):
        decode_rgb(encoded(pattern(20, 20), "PNG"), 100)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_corrupt_images_are_bad_media(fmt):
    data = encoded(pattern(64, 48), fmt)
    with pytest.raises(BadMedia):
        decode_rgb(data[: len(data) // 2], 10**6)
    with pytest.raises(BadMedia):
        decode_rgb(b"\x00garbage" * 20, 10**6)


def test_backend_registry():
    assert set(IMAGE_BACKENDS) >= {"torchvision", "dali"}
    with pytest.raises(ValueError, match="unknown image backend"):
        make_image_backend("nope", ImagePreprocessConfig(64, 64), torch.device("cpu"), 100)


@pytest.mark.parametrize("size", SIZES[:4])
@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_dali_backend_close_to_hf(processor_dir, size, fmt):
    """DALI's antialiased resize differs from torchvision's at strong downscales; measured on
    these patterns: max |diff| 0.118 (15 uint8 levels at a few edge pixels), mean <= 0.0017."""
    pytest.importorskip("nvidia.dali", reason="nvidia-dali is not installed")
    from transformers import AutoImageProcessor

    cfg = ImagePreprocessConfig.from_json(processor_dir / "preprocessor_config.json")
    backend = make_image_backend("dali", cfg, torch.device("cpu"), 10**8)
    data = encoded(pattern(*size), fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    ref = AutoImageProcessor.from_pretrained(processor_dir)(images=Image.open(io.BytesIO(data)), return_tensors="pt")["pixel_values"]
    ours = backend.images([data])
    assert ours.shape == ref.shape == (1, 3, 64, 64) and ours.dtype == torch.float32
    diff = (ours - ref).abs()
    assert diff.max() < 0.15 and diff.mean() < 0.003, (diff.max(), diff.mean())


def test_dali_backend_batches_falls_back_and_rejects(mimo_bundle):
    pytest.importorskip("nvidia.dali", reason="nvidia-dali is not installed")
    cfg = ImagePreprocessConfig.from_json(mimo_bundle / "vision" / "preprocessor_config.json")
    dali = make_image_backend("dali", cfg, torch.device("cpu"), 10**6)
    tv = make_image_backend("torchvision", cfg, torch.device("cpu"), 10**6)
    blobs = [encoded(pattern(64, 64, 1), "PNG"), encoded(pattern(64, 64, 2), "GIF"), encoded(pattern(64, 64, 3), "PNG")]
    out = dali.images(blobs)
    assert out.shape == (3, 3, 64, 64)
    torch.testing.assert_close(out, tv.images(blobs), atol=1e-6, rtol=0)  # 64x64: no resize, same pixels
    png = encoded(pattern(64, 48), "PNG")
    with pytest.raises(BadMedia):
        dali.images([png[: len(png) // 2]])
    with pytest.raises(MediaTooLarge):
        dali.images([_png_claiming(100_000, 100_000)])
    assert dali.images([png]).shape == (1, 3, 64, 64)  # still works after a failure


# ---- audio features ------------------------------------------------------------------------


def test_log_mel_matches_whisper_feature_extractor(mimo_bundle):
    from transformers import WhisperFeatureExtractor

    from encoder_svc.preprocess.mel import features

    fe = WhisperFeatureExtractor.from_pretrained(mimo_bundle / "audio")
    rng = np.random.default_rng(0)
    for seconds in (0.7, 7.3, 30.0):
        n = int(16000 * seconds)
        t = np.arange(n) / 16000
        w = (0.3 * np.sin(2 * np.pi * 440 * t) + rng.normal(0, 0.05, n)).astype(np.float32)
        ref = fe(w, sampling_rate=16000, return_tensors="pt").input_features  # [1, 80, 3000]
        ours, spans = features(torch.from_numpy(w), 80)
        assert ours.shape == (1, 80, 3000) and len(spans) == 1
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_windows_and_token_counts():
    from encoder_svc.preprocess.mel import windows

    spans = windows(16000 * 65 + 8)  # 65 s and half a millisecond
    assert [(w.start, w.num_samples) for w in spans] == [(0, 480000), (480000, 480000), (960000, 80008)]
    assert [w.valid_frames() for w in spans] == [1500, 1500, math.ceil(80008 / 16000 * 50)]
    assert [w.num_tokens(20) for w in spans] == [75, 75, math.ceil(251 / 20)]


@pytest.mark.parametrize("fmt", ["WAV", "FLAC", "OGG"])
def test_decode_audio_soundfile_formats(fmt):
    import soundfile as sf

    from encoder_svc.preprocess.audio_decode import decode_audio

    sr = 22050
    t = np.arange(int(sr * 1.5)) / sr
    stereo = np.stack([0.5 * np.sin(2 * np.pi * 330 * t), 0.1 * np.sin(2 * np.pi * 330 * t)], -1).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, stereo, sr, format=fmt)
    wave = decode_audio(buf.getvalue())
    assert wave.shape == (24000,)
    want = torch.from_numpy(0.3 * np.sin(2 * np.pi * 330 * np.arange(24000) / 16000)).float()
    mid = slice(2000, 22000)  # away from resampler edges
    err = (wave[mid] - want[mid]).abs().max()
    assert err < (0.01 if fmt != "OGG" else 0.05), err


def test_decode_audio_rejects_garbage():
    from encoder_svc.preprocess.audio_decode import decode_audio

    with pytest.raises(BadMedia, match="cannot decode the audio"):
        decode_audio(b"RIFF\x00\x00\x00\x00WAVEjunkjunk" * 4)
