"""Audio encoder: log-mel windows [B, n_mels, 3000] -> LM-space tokens [B, 1500/stride, hidden].

Whisper's encoder (conv stride 2 -> 50 frames/s, 1500 frames per 30 s window) followed by
``shared.projector.PoolProjector`` (seq1d, ``pool_stride`` frames per token). The service keeps
only the tokens that cover real audio (see ``encoder_svc.preprocess.audio``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from shared.bundle import AudioSpec, BundleError
from shared.projector import PoolProjector


class AudioEncoder(nn.Module):
    def __init__(self, encoder: nn.Module, projector: PoolProjector, n_mels: int, hidden_size: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.projector = projector
        self.n_mels = n_mels
        self.hidden_size = hidden_size
        self.stride = projector.cfg.stride

    @torch.inference_mode()
    def forward(self, features: torch.Tensor) -> torch.Tensor:
        # features: [B, n_mels, 3000] -> encoder [B, 1500, Da] -> projector [B, 75, H]
        dtype = next(self.encoder.parameters()).dtype
        h = self.encoder(input_features=features.to(dtype)).last_hidden_state
        return self.projector(h)


def load_audio(root: Path, spec: AudioSpec, dtype: torch.dtype) -> AudioEncoder:
    from transformers import WhisperModel

    if spec.kind != "whisper_projector":
        raise BundleError(f"unknown audio kind {spec.kind!r}; known: ['whisper_projector']")
    d = root / spec.path
    whisper = WhisperModel.from_pretrained(d, dtype=dtype)
    encoder = whisper.get_encoder().eval()
    projector = PoolProjector.load(d).to(dtype).eval()
    if projector.cfg.pool != "seq1d" or projector.cfg.stride != spec.pool_stride:
        raise BundleError(f"{d}: projector stride {projector.cfg.stride} != manifest pool_stride {spec.pool_stride}")
    return AudioEncoder(encoder, projector, whisper.config.num_mel_bins, projector.cfg.out_dim)
