"""audio: 16 kHz mono -> 30 s windows -> log-mel -> Whisper encoder + projector -> kept tokens.

Window ``k`` contributes its first ``ceil(ceil(seconds_k * 50) / pool_stride)`` tokens (the ones
that cover real audio, not the zero padding); windows are concatenated in order.
"""

from __future__ import annotations

import torch

from encoder_svc.errors import BadMedia
from encoder_svc.modalities.context import EncodeContext
from encoder_svc.preprocess.audio_decode import TARGET_SR, decode_audio
from encoder_svc.preprocess.mel import features
from shared.schemas import EncodeParams


def cache_signature(ctx: EncodeContext, params: EncodeParams) -> str:
    return f"aud:{TARGET_SR}:{ctx.models.audio.n_mels}:30s:{ctx.models.audio.stride}"


def _prepare(data: bytes, n_mels: int):
    wave = decode_audio(data)
    if wave.numel() == 0:
        raise BadMedia("the audio has no samples")
    return features(wave, n_mels)


async def encode(ctx: EncodeContext, data: bytes, params: EncodeParams) -> torch.Tensor:
    audio = ctx.models.audio
    with ctx.batcher.incoming():
        feats, spans = await ctx.in_pool(_prepare, data, audio.n_mels)  # [K, n_mels, 3000]
    out = await ctx.batcher.run("audio", feats)  # [K, 1500 / stride, H]
    kept = [out[k, : w.num_tokens(audio.stride)] for k, w in enumerate(spans)]
    return torch.cat(kept)  # [sum_k tokens_k, H]
