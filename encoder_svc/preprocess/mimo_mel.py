"""MiMo audio log-mel: what vLLM's ``MiMoVLProcessor.preprocess_audio`` computes.

``torchaudio.transforms.MelSpectrogram(sample_rate, n_fft, win_length, hop_length, f_min, f_max,
n_mels, power=1.0, center=True)`` (periodic Hann, reflect padding, HTK mel scale, no filter
norm) -> ``log(clamp(x, 1e-7))``. Magnitude (power 1), not power: the tokenizer was trained on it.
Works on any device (the waveform's).
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torchaudio.transforms import MelSpectrogram


@lru_cache(maxsize=8)
def _mel(sr: int, n_fft: int, win_length: int, hop: int, n_mels: int, fmin: float, fmax: float | None,
         device: str) -> MelSpectrogram:
    return MelSpectrogram(sample_rate=sr, n_fft=n_fft, win_length=win_length, hop_length=hop, f_min=fmin,
                          f_max=fmax, n_mels=n_mels, power=1.0, center=True).to(device)


def mel_magnitude(wave: torch.Tensor, *, sr: int, n_fft: int, win_length: int, hop: int, n_mels: int,
                  fmin: float = 0.0, fmax: float | None = None) -> torch.Tensor:
    """[n] float mono samples at ``sr`` -> [n_mels, 1 + n // hop] mel of the STFT magnitude."""
    assert wave.ndim == 1, wave.shape
    x = wave.to(torch.float32)
    # torchaudio hands back a transposed view; callers save and batch it as a plain [n_mels, frames]
    return _mel(sr, n_fft, win_length, hop, n_mels, fmin, fmax, str(x.device))(x).contiguous()


def log_mel(wave: torch.Tensor, **params) -> torch.Tensor:
    """``mel_magnitude`` -> log, floored at 1e-7: the tokenizer's input features."""
    return torch.clamp(mel_magnitude(wave, **params), min=1e-7).log()
