"""Test audio: a deterministic signal with varied content, for the audio tower's tests and the
omni audio benchmark."""

from __future__ import annotations

import math

import torch

SR = 24000  # MiMo audio's sample rate


def chirp(seconds: float, seed: int = 0) -> torch.Tensor:
    """0.2 s pieces cycling through silence, a tone, noise and a square wave (varied codes)."""
    g = torch.Generator().manual_seed(seed)
    n, piece = int(SR * seconds), SR // 5
    t = torch.arange(piece) / SR
    parts, k = [], 0
    while sum(p.numel() for p in parts) < n:
        f = 100.0 * (1 + (k * 7 + seed) % 13)
        parts.append([torch.zeros(piece), 0.5 * torch.sin(2 * math.pi * f * t),
                      0.3 * torch.randn(piece, generator=g), 0.4 * torch.sign(torch.sin(2 * math.pi * f / 3 * t))][k % 4])
        k += 1
    return torch.cat(parts)[:n].float()
