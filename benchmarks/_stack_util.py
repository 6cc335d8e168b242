"""Helpers shared by the stack e2e tests and ``benchmarks.e2e_load``: real media files (PNG via
PIL, H.264 MP4 via the ffmpeg CLI, WAV via soundfile), OpenAI message parts, and Prometheus
counters scraped from a service's ``/metrics``."""

from __future__ import annotations

import base64
import io
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families


# ---- media -------------------------------------------------------------------------------------
def make_png(width: int = 48, height: int = 40, seed: int = 0) -> bytes:
    """A real PNG with a seed-dependent pattern."""
    from PIL import Image

    x = np.arange(width)[None, :]
    y = np.arange(height)[:, None]
    rgb = np.stack(
        [(x * 7 + seed * 31 + 0 * y) % 256, (y * 5 + seed * 17 + 0 * x) % 256, (x * y + seed) % 256], axis=-1
    ).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def make_mp4(seconds: float = 2.0, size: int = 64, fps: int = 8, seed: int = 0) -> bytes:
    """A real H.264 MP4 (ffmpeg's ``testsrc`` pattern, hue shifted by ``seed``)."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "clip.mp4"
        subprocess.run(
            [
                "ffmpeg", "-nostdin", "-y", "-loglevel", "error",
                "-f", "lavfi", "-i", f"testsrc=size={size}x{size}:rate={fps}:duration={seconds}",
                "-vf", f"hue=h={(seed * 47) % 360}",
                "-c:v", "libx264", "-pix_fmt", "yuv420p", "-movflags", "+faststart", str(out),
            ],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        return out.read_bytes()


def make_wav(seconds: float = 1.0, rate: int = 16000, freq: float = 440.0) -> bytes:
    """A real 16-bit PCM WAV of a sine tone."""
    import soundfile as sf

    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_part(png: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url("image/png", png)}}


def video_part(mp4: bytes) -> dict:
    return {"type": "video_url", "video_url": {"url": data_url("video/mp4", mp4)}}


def audio_part(wav: bytes) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}


def user(text: str, *parts: dict) -> dict:
    """A user message: the text first, then the media parts."""
    return {"role": "user", "content": [{"type": "text", "text": text}, *parts]}


# ---- metrics -----------------------------------------------------------------------------------
Samples = dict[tuple[str, frozenset], float]


def scrape(base_url: str, timeout: float = 5.0) -> Samples:
    """Every sample of ``{base_url}/metrics``: ``(sample name, frozenset(labels)) -> value``."""
    r = httpx.get(f"{base_url}/metrics", timeout=timeout)
    r.raise_for_status()
    out: Samples = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def totals(urls: Iterable[str], name: str, **labels: str) -> list[float]:
    """``total(scrape(url), name, **labels)`` for each URL."""
    return [total(scrape(u), name, **labels) for u in urls]
