"""Video and audio over real HTTP vs an independent transformers oracle."""

from __future__ import annotations

import io
import math
import subprocess

import httpx
import numpy as np
import pytest
import soundfile as sf
import torch
from PIL import Image

from encoder_svc.app import create_app
from encoder_svc.server import serve_in_thread
from shared.schemas import EncodeResult
from shared.settings import EncoderSettings
from shared.wire import unpack

pytestmark = pytest.mark.integration


def ffmpeg(*args: str) -> None:
    subprocess.run(["ffmpeg", "-loglevel", "error", "-y", *args], check=True)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    src = ["-f", "lavfi", "-i", "testsrc=size=160x120:rate=30", "-t", "3"]
    ffmpeg(*src, "-c:v", "libx264", "-pix_fmt", "yuv420p", str(d / "v.mp4"))
    ffmpeg(*src, "-c:v", "libvpx-vp9", "-b:v", "300k", "-deadline", "realtime", "-cpu-used", "8", str(d / "v.webm"))
    ffmpeg("-f", "lavfi", "-i", "sine=frequency=440:duration=2.5", "-ar", "44100", str(d / "a.mp3"))
    ffmpeg("-f", "lavfi", "-i", "sine=frequency=300:duration=2", "-ac", "2", "-ar", "22050", str(d / "a.ogg"))
    rng = np.random.default_rng(0)
    out = {p.name: p.read_bytes() for p in d.iterdir()}
    for fmt, seconds in (("WAV", 35.0), ("FLAC", 3.3)):
        sr = 24000
        t = np.arange(int(sr * seconds)) / sr
        wave = np.stack([0.4 * np.sin(2 * np.pi * 220 * t), rng.normal(0, 0.05, t.size)], -1).astype(np.float32)
        buf = io.BytesIO()
        sf.write(buf, wave, sr, format=fmt)
        out[fmt.lower()] = buf.getvalue()
    return out


@pytest.fixture(scope="module")
def url(mimo_bundle):
    s = EncoderSettings(model_dir=str(mimo_bundle), cache_bytes=0, video_max_frames=8, video_fps=2.0)
    app = create_app(s)
    with serve_in_thread(app) as u:
        yield u
        app.state.service.check_integrity()
        assert app.state.service.ctx.batcher.pending() == 0


@pytest.fixture(scope="module")
def oracle(mimo_bundle):
    from transformers import AutoImageProcessor, SiglipVisionModel, WhisperFeatureExtractor, WhisperModel

    from shared.projector import PoolProjector

    v, a = mimo_bundle / "vision", mimo_bundle / "audio"
    return {
        "proc": AutoImageProcessor.from_pretrained(v),
        "tower": SiglipVisionModel.from_pretrained(v).eval(),
        "vproj": PoolProjector.load(v),
        "fe": WhisperFeatureExtractor.from_pretrained(a),
        "whisper": WhisperModel.from_pretrained(a).eval(),
        "aproj": PoolProjector.load(a),
    }


def post(url: str, data: bytes, **params) -> httpx.Response:
    return httpx.post(f"{url}/v1/encode", params=params, content=data, timeout=120)


def embeds_of(r: httpx.Response) -> tuple[torch.Tensor, EncodeResult]:
    assert r.status_code == 200, r.text
    t, res = unpack(r.content, EncodeResult)
    return t["embeds"], res


@torch.no_grad()
def video_oracle(o, data: bytes, fps: float, max_frames: int) -> torch.Tensor:
    from torchcodec.decoders import VideoDecoder

    dec = VideoDecoder(data)
    total, vfps = dec.metadata.num_frames, dec.metadata.average_fps
    num = max(1, min(int(total / vfps * fps), max_frames, total))
    idx = torch.arange(0, total, total / num).int()[:num].tolist()
    frames = dec.get_frames_at(idx).data.permute(0, 2, 3, 1).numpy()
    px = o["proc"](images=[Image.fromarray(f) for f in frames], return_tensors="pt")["pixel_values"]
    per = o["vproj"](o["tower"](pixel_values=px).last_hidden_state)  # [F, 16, 64]
    groups = []
    for s in range(0, len(per), 2):
        g = per[s : s + 2]
        if len(g) == 1:
            g = torch.cat([g, g])
        groups.append(g.mean(0))
    return torch.cat(groups)


@pytest.mark.parametrize("name", ["v.mp4", "v.webm"])
def test_video_matches_oracle(url, oracle, media, name):
    e, res = embeds_of(post(url, media[name], modality="video", fps=2.0))
    want = video_oracle(oracle, media[name], 2.0, 8)  # 3 s at 2 fps = 6 frames -> 3 groups
    assert e.shape == want.shape == (48, 64) and res.num_tokens == 48
    torch.testing.assert_close(e, want, atol=1e-4, rtol=0)


def test_video_params_and_odd_frame_count(url, oracle, media):
    e, _ = embeds_of(post(url, media["v.mp4"], modality="video", fps=5.0, max_frames=5))
    want = video_oracle(oracle, media["v.mp4"], 5.0, 5)  # capped to 5 -> groups of 2, 2, 1(+pad)
    assert e.shape == (48, 64)
    torch.testing.assert_close(e, want, atol=1e-4, rtol=0)
    default, _ = embeds_of(post(url, media["v.mp4"], modality="video"))  # settings: 2 fps, max 8
    assert default.shape == (48, 64)


def test_corrupt_video_is_400(url, media):
    for bad in (media["v.mp4"][: len(media["v.mp4"]) // 3], b"\x1aE\xdf\xa3" + b"garbage" * 50):
        r = post(url, bad, modality="video")
        assert r.status_code == 400 and "video" in r.json()["error"]["message"], r.text


def reference_decode(data: bytes, rate: int) -> torch.Tensor:
    """An independent decode: soundfile (torchcodec for what it cannot read), channel mean,
    torchaudio resample to ``rate``."""
    import torchaudio.functional as AF

    try:
        wave, sr = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
        wave = torch.from_numpy(wave).T
    except sf.LibsndfileError:
        from torchcodec.decoders import AudioDecoder

        s = AudioDecoder(data).get_all_samples()
        wave, sr = s.data, s.sample_rate
    return AF.resample(wave.mean(0), sr, rate)


@torch.no_grad()
def audio_oracle(o, data: bytes) -> torch.Tensor:
    mono = reference_decode(data, 16000).numpy()
    outs = []
    for start in range(0, len(mono), 480000):
        win = mono[start : start + 480000]
        feats = o["fe"](win, sampling_rate=16000, return_tensors="pt").input_features
        h = o["aproj"](o["whisper"].encoder(input_features=feats).last_hidden_state)[0]  # [75, 64]
        outs.append(h[: math.ceil(math.ceil(len(win) / 16000 * 50) / 20)])
    return torch.cat(outs)


@pytest.mark.parametrize("name,tokens", [("wav", 75 + 13), ("flac", 9), ("a.mp3", 7), ("a.ogg", 5)])
def test_audio_matches_oracle(url, oracle, media, name, tokens):
    e, res = embeds_of(post(url, media[name], modality="audio"))
    want = audio_oracle(oracle, media[name])
    assert e.shape == want.shape == (tokens, 64) and res.modality == "audio"
    torch.testing.assert_close(e, want, atol=1e-4, rtol=0)


def test_bad_audio_is_400(url):
    r = post(url, b"ID3" + b"\x00" * 200, modality="audio")
    assert r.status_code == 400 and "audio" in r.json()["error"]["message"], r.text


def test_gemma3_video_uses_get_image_features(gemma3_bundle, media):
    from transformers import AutoImageProcessor, Gemma3ForConditionalGeneration

    s = EncoderSettings(model_dir=str(gemma3_bundle), cache_bytes=0, video_max_frames=3)
    with serve_in_thread(create_app(s)) as u:
        e, _ = embeds_of(post(u, media["v.mp4"], modality="video", fps=1.0))
    from torchcodec.decoders import VideoDecoder

    frames = VideoDecoder(media["v.mp4"]).get_frames_at([0, 30, 60]).data.permute(0, 2, 3, 1).numpy()
    px = AutoImageProcessor.from_pretrained(gemma3_bundle)(images=[Image.fromarray(f) for f in frames], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        per = Gemma3ForConditionalGeneration.from_pretrained(gemma3_bundle).get_image_features(pixel_values=px).pooler_output
    want = torch.cat([per[0:2].mean(0), per[2]])
    torch.testing.assert_close(e, want, atol=1e-4, rtol=0)
