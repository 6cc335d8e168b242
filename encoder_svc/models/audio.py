"""Audio towers, one per ``AudioSpec.kind`` (registry ``AUDIO_LOADERS``), behind one interface.

A tower (``nn.Module``) offers:

* ``sample_rate``: the rate the decoder resamples to;
* ``prepare(wave [n]) -> AudioItems``: batch items in groups of one shape (equal-shape items of
  many requests fuse in one forward) and ``tokens[k]``, the rows of item k's output to keep;
* ``forward(features [B, *item]) -> [B, rows, hidden]`` (rows >= every item's ``tokens``);
* ``cache_signature()``: the preprocessing parameters that go into the embedding-cache key;
* ``hidden_size``.

Kinds:

* ``whisper_projector`` (mmserve bundle): log-mel windows [n_mels, 3000] -> Whisper encoder (conv
  stride 2 -> 50 frames/s, 1500 frames per 30 s window) -> ``shared.projector.PoolProjector``
  (seq1d, ``pool_stride`` frames per token); a window keeps the tokens that cover real audio.
* ``mimo_omni`` (MiMo-V2.5 omni checkpoint as published): ``encoder_svc.models.mimo_audio``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn

from encoder_svc.models.audio_items import AudioItems
from encoder_svc.preprocess.mel import SAMPLE_RATE as WHISPER_SR, features as whisper_features
from shared.bundle import AudioSpec, BundleError
from shared.projector import PoolProjector
from shared.registry import Registry

# kind -> loader(root, spec, dtype) of its tower
AUDIO_LOADERS: Registry[Callable[[Path, AudioSpec, torch.dtype], nn.Module]] = Registry("audio kind", error=BundleError)


class AudioEncoder(nn.Module):
    """Whisper encoder + projector: [B, n_mels, 3000] -> [B, 1500 / stride, H]."""

    sample_rate = WHISPER_SR

    def __init__(self, encoder: nn.Module, projector: PoolProjector, n_mels: int, hidden_size: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.projector = projector
        self.n_mels = n_mels
        self.hidden_size = hidden_size
        self.stride = projector.cfg.stride

    def cache_signature(self) -> str:
        return f"aud:{WHISPER_SR}:{self.n_mels}:30s:{self.stride}"

    def prepare(self, wave: torch.Tensor) -> AudioItems:
        feats, spans = whisper_features(wave, self.n_mels)  # [K, n_mels, 3000]
        return AudioItems([feats], [w.num_tokens(self.stride) for w in spans])

    @torch.inference_mode()
    def forward(self, features: torch.Tensor) -> torch.Tensor:
        # features: [B, n_mels, 3000] -> encoder [B, 1500, Da] -> projector [B, 75, H]
        dtype = next(self.encoder.parameters()).dtype
        h = self.encoder(input_features=features.to(dtype)).last_hidden_state
        return self.projector(h)


@AUDIO_LOADERS.register("whisper_projector")
def _load_whisper(root: Path, spec: AudioSpec, dtype: torch.dtype) -> AudioEncoder:
    from transformers import WhisperModel

    d = root / spec.path
    whisper = WhisperModel.from_pretrained(d, dtype=dtype)
    encoder = whisper.get_encoder().eval()
    projector = PoolProjector.load(d).to(dtype).eval()
    if projector.cfg.pool != "seq1d" or projector.cfg.stride != spec.pool_stride:
        raise BundleError(f"{d}: projector stride {projector.cfg.stride} != manifest pool_stride {spec.pool_stride}")
    return AudioEncoder(encoder, projector, whisper.config.num_mel_bins, projector.cfg.out_dim)


@AUDIO_LOADERS.register("mimo_omni")
def _load_mimo(root: Path, spec: AudioSpec, dtype: torch.dtype) -> nn.Module:
    import json

    from encoder_svc.models.mimo_audio_weights import load_mimo_audio

    d = (root / spec.path).resolve()
    lm_hidden = json.loads((d / "config.json").read_text()).get("hidden_size")
    return load_mimo_audio(d, dtype, lm_hidden)


def load_audio(root: Path, spec: AudioSpec, dtype: torch.dtype) -> nn.Module:
    """The tower of ``spec.kind``; an unknown kind is a ``BundleError``."""
    return AUDIO_LOADERS.get(spec.kind)(root, spec, dtype)
