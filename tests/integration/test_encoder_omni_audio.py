"""The encoder service on the tiny MiMo-V2.5 omni checkpoint's audio side, over real HTTP: real decoded WAV /
FLAC / MP3 (resampled to 24 kHz), placeholder counts as vLLM's MiMo processor computes them,
embeddings equal to the tower run on an independently decoded waveform, cross-request batches
of mixed lengths equal to one-at-a-time, the embedding cache, and clear 400s."""

from __future__ import annotations

import io
import json
import subprocess
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import soundfile as sf
import torch

from encoder_svc.app import create_app
from encoder_svc.models.mimo_audio_weights import load_mimo_audio
from encoder_svc.preprocess.audio_decode import decode_audio
from encoder_svc.server import serve_in_thread
from shared.schemas import EncodeResult
from shared.settings import EncoderSettings
from mmserve.tiny.mimo_omni import write_mimo_omni
from shared.wire import unpack
from tests.integration.test_encoder_media import reference_decode
from mmserve.testing.audio import chirp
from tests.unit.test_omni_audio import vllm_token_len

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The tiny MiMo-V2.5 omni checkpoint as published, read as is (no manifest): LM, ViT and
    the audio side in one directory."""
    return write_mimo_omni(tmp_path_factory.mktemp("omni-audio-svc") / "ckpt", seed=5)


@pytest.fixture(scope="module")
def hidden(ckpt) -> int:
    return json.loads((ckpt / "config.json").read_text())["hidden_size"]


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    out = {}
    for name, fmt, sr, seconds, stereo in (("wav", "WAV", 44100, 2.5, True), ("flac", "FLAC", 24000, 17.3, False)):
        w = chirp(seconds, seed=len(out)).numpy()  # 24 kHz content, stretched to the file's rate
        w = np.interp(np.arange(int(sr * seconds)) / sr * 24000, np.arange(w.size), w).astype(np.float32)
        buf = io.BytesIO()
        sf.write(buf, np.stack([w, 0.5 * w], -1) if stereo else w, sr, format=fmt)
        out[name] = buf.getvalue()
    d = tmp_path_factory.mktemp("omni-audio-media")
    subprocess.run(["ffmpeg", "-loglevel", "error", "-y", "-f", "lavfi", "-i", "sine=frequency=330:duration=3.1",
                    "-ar", "16000", str(d / "a.mp3")], check=True)
    out["mp3"] = (d / "a.mp3").read_bytes()
    return out


@pytest.fixture(scope="module")
def url(ckpt):
    s = EncoderSettings(model_dir=str(ckpt), cache_bytes=64 << 20, max_batch_size=8, max_wait_ms=50.0)
    app = create_app(s)
    with serve_in_thread(app) as u:
        yield u
        app.state.service.check_integrity()
        app.state.service.ctx.models.audio.check_integrity()
        assert app.state.service.ctx.batcher.pending() == 0


def post(url: str, data: bytes) -> httpx.Response:
    return httpx.post(f"{url}/v1/encode", params={"modality": "audio"}, content=data, timeout=300)


def embeds_of(r: httpx.Response) -> tuple[torch.Tensor, EncodeResult]:
    assert r.status_code == 200, r.text
    t, res = unpack(r.content, EncodeResult)
    return t["embeds"], res


@pytest.mark.parametrize("name", ["wav", "flac", "mp3"])
def test_audio_request_matches_the_tower(url, ckpt, hidden, media, name):
    """Two checks: the service's decode equals an independent one (to float error), and its
    embeddings equal the tower on that decode. Not the tower on the independent decode: a
    1e-8 difference in the samples can flip a near-tied RVQ code (a pure tone has many)."""
    e, res = embeds_of(post(url, media[name]))
    wave = decode_audio(media[name], 24000)
    torch.testing.assert_close(wave, reference_decode(media[name], 24000), atol=1e-6, rtol=0)
    tower = load_mimo_audio(ckpt, torch.float32, hidden)
    items = tower.prepare(wave)
    want = items.kept([tower(g) for g in items.groups])
    assert res.modality == "audio" and res.hidden_size == hidden
    assert e.shape[0] == res.num_tokens == vllm_token_len(1 + wave.numel() // 240) == want.shape[0]
    assert len(items.tokens) == (3 if name == "flac" else 1)  # 17.3 s: segments of 8 s
    torch.testing.assert_close(e, want, atol=1e-5, rtol=0)


def test_concurrent_mixed_lengths_equal_sequential(url, media):
    """Twelve requests at once (several lengths, so several batch shapes; 9.5 s and 12 s span two
    segments): each answer equals the one it got alone; the six new clips get their counts."""
    def wav(seconds: float, seed: int) -> bytes:
        buf = io.BytesIO()
        sf.write(buf, chirp(seconds, seed).numpy(), 24000, format="WAV")
        return buf.getvalue()

    bodies = [wav(s, i) for i, s in enumerate((0.6, 4.2, 9.5, 0.6, 4.2, 12.0))]
    alone = [embeds_of(post(url, b))[0] for b in bodies]
    salted = [wav(s, i + 100) for i, s in enumerate((0.6, 4.2, 9.5, 0.6, 4.2, 12.0))]
    with ThreadPoolExecutor(6) as ex:
        together = list(ex.map(lambda b: embeds_of(post(url, b))[0], bodies + salted))
    for a, b in zip(alone, together[:6]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for seconds, t in zip((0.6, 4.2, 9.5, 0.6, 4.2, 12.0), together[6:]):
        assert t.shape[0] == vllm_token_len(1 + int(24000 * seconds) // 240)


def test_repeat_is_cached(url):
    buf = io.BytesIO()
    sf.write(buf, chirp(1.5, seed=77).numpy(), 24000, format="FLAC")
    a, ra = embeds_of(post(url, buf.getvalue()))
    b, rb = embeds_of(post(url, buf.getvalue()))
    assert rb.cached and not ra.cached and torch.equal(a, b) and rb.key == ra.key


def test_model_id_covers_the_tokenizer_weights(ckpt, tmp_path):
    """The cache key's model id changes when only audio_tokenizer/model.safetensors changes."""
    import shutil

    from safetensors.torch import load_file, save_file

    from encoder_svc.models.loader import load_models
    from shared.bundle import load_bundle_spec

    same = shutil.copytree(ckpt, tmp_path / "a" / "ckpt")
    other = shutil.copytree(ckpt, tmp_path / "b" / "ckpt")
    f = other / "audio_tokenizer" / "model.safetensors"
    t = load_file(str(f))
    t["encoder.quantizer.vq.layers.0._codebook.embed"] = t["encoder.quantizer.vq.layers.0._codebook.embed"].flip(0)
    save_file(t, str(f))
    ids = [load_models(load_bundle_spec(d)).model_id for d in (ckpt, same, other)]
    assert ids[0] == ids[1] != ids[2]


def test_too_short_and_undecodable_audio_are_400(url):
    buf = io.BytesIO()
    sf.write(buf, np.zeros(200, np.float32), 24000, format="WAV")
    r = post(url, buf.getvalue())
    assert r.status_code == 400 and "ms long" in r.json()["error"]["message"], r.text
    r = post(url, b"RIFF\x00\x00\x00\x00WAVEjunk" * 8)
    assert r.status_code == 400 and "audio" in r.json()["error"]["message"], r.text
