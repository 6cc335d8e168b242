"""MiMo audio log-mel: what vLLM's ``MiMoVLProcessor.preprocess_audio`` computes, in plain torch.

``torchaudio.transforms.MelSpectrogram(sample_rate, n_fft, win_length, hop_length, f_min, f_max,
n_mels, power=1.0, center=True)`` (periodic Hann, reflect padding, HTK mel scale, no filter
norm) -> ``log(clamp(x, 1e-7))``. Magnitude (power 1), not power: the tokenizer was trained on it.
Works on any device (the waveform's).
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torchaudio.functional as AF


@lru_cache(maxsize=8)
def _fbank(n_fft: int, n_mels: int, sr: int, fmin: float, fmax: float | None, device: str) -> torch.Tensor:
    # [n_fft // 2 + 1, n_mels]
    fb = AF.melscale_fbanks(n_fft // 2 + 1, fmin, fmax if fmax is not None else sr / 2, n_mels, sr,
                            norm=None, mel_scale="htk")
    return fb.to(device)


def mel_magnitude(wave: torch.Tensor, *, sr: int, n_fft: int, win_length: int, hop: int, n_mels: int,
                  fmin: float = 0.0, fmax: float | None = None) -> torch.Tensor:
    """[n] float mono samples at ``sr`` -> [n_mels, 1 + n // hop] mel of the STFT magnitude."""
    assert wave.ndim == 1, wave.shape
    x = wave.to(torch.float32)
    window = torch.hann_window(win_length, device=x.device)
    spec = torch.stft(x, n_fft, hop, win_length, window, center=True, pad_mode="reflect",
                      return_complex=True).abs()  # [n_fft // 2 + 1, frames]
    return _fbank(n_fft, n_mels, sr, fmin, fmax, str(x.device)).T @ spec  # [n_mels, frames]


def log_mel(wave: torch.Tensor, **params) -> torch.Tensor:
    """``mel_magnitude`` -> log, floored at 1e-7: the tokenizer's input features."""
    return torch.clamp(mel_magnitude(wave, **params), min=1e-7).log()
