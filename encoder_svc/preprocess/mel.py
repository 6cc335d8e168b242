"""Whisper log-mel features in torch, equal to ``WhisperFeatureExtractor`` (within float error).

A waveform at 16 kHz is split into 30 s windows; each window is zero-padded to 480000 samples,
STFT (n_fft 400, hop 160, periodic Hann, centered, reflect) -> power -> the last frame dropped ->
Slaney mel filters (0-8 kHz) -> log10 clamped at 1e-10 -> floored at (max - 8) -> (x + 4) / 4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import torchaudio.functional as AF

SAMPLE_RATE = 16_000
N_FFT = 400
HOP = 160
WINDOW_SECONDS = 30
WINDOW_SAMPLES = WINDOW_SECONDS * SAMPLE_RATE  # 480000
FRAMES_PER_WINDOW = WINDOW_SAMPLES // HOP  # 3000 mel frames
ENCODER_FPS = 50  # Whisper's conv stride 2 halves 100 mel frames/s


@dataclass(frozen=True)
class AudioWindow:
    start: int  # sample offset in the 16 kHz waveform
    num_samples: int

    @property
    def seconds(self) -> float:
        return self.num_samples / SAMPLE_RATE

    def valid_frames(self) -> int:
        """Encoder frames (50/s) that cover real audio."""
        return math.ceil(self.seconds * ENCODER_FPS)

    def num_tokens(self, stride: int) -> int:
        return math.ceil(self.valid_frames() / stride)


def windows(num_samples: int) -> list[AudioWindow]:
    return [
        AudioWindow(s, min(WINDOW_SAMPLES, num_samples - s)) for s in range(0, num_samples, WINDOW_SAMPLES)
    ]


@lru_cache(maxsize=4)
def mel_filters(n_mels: int, device: str = "cpu") -> torch.Tensor:
    # [n_freqs=201, n_mels], Slaney scale and norm as transformers' mel_filter_bank
    fb = AF.melscale_fbanks(N_FFT // 2 + 1, 0.0, 8000.0, n_mels, SAMPLE_RATE, norm="slaney", mel_scale="slaney")
    return fb.to(device)


def log_mel(wave: torch.Tensor, n_mels: int = 80) -> torch.Tensor:
    """[n <= 480000] samples -> [n_mels, 3000] features of one zero-padded 30 s window."""
    assert wave.ndim == 1 and wave.numel() <= WINDOW_SAMPLES, wave.shape
    x = torch.nn.functional.pad(wave.to(torch.float32), (0, WINDOW_SAMPLES - wave.numel()))
    window = torch.hann_window(N_FFT, device=x.device)
    stft = torch.stft(x, N_FFT, HOP, window=window, return_complex=True)  # [201, 3001]
    power = (stft[..., :-1].abs() ** 2).contiguous()  # [201, 3000]
    mel = mel_filters(n_mels, str(x.device)).T @ power  # [n_mels, 3000]
    log_spec = torch.clamp(mel, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


def features(wave: torch.Tensor, n_mels: int = 80) -> tuple[torch.Tensor, list[AudioWindow]]:
    """All windows of a waveform: [num_windows, n_mels, 3000] and their spans."""
    spans = windows(wave.numel())
    feats = torch.stack([log_mel(wave[w.start : w.start + w.num_samples], n_mels) for w in spans])
    return feats, spans
