"""audio: bytes -> mono waveform at the tower's rate -> the tower's batch items -> kept tokens.

The tower (``encoder_svc.models.audio``) says how a waveform becomes items (Whisper: 30 s
windows; MiMo: 60 s mel segments) and how many output rows of each item cover real audio;
items are encoded through the cross-request batcher and their kept rows concatenated in order.
"""

from __future__ import annotations

import asyncio

import torch

from encoder_svc.decode_limits import DecodeGuard
from encoder_svc.errors import BadMedia
from encoder_svc.modalities.context import EncodeContext
from encoder_svc.preprocess.audio_decode import AudioLimits, decode_audio
from shared.schemas import EncodeParams


def cache_signature(ctx: EncodeContext, params: EncodeParams) -> str:
    return ctx.models.audio.cache_signature()


def _prepare(ctx: EncodeContext, data: bytes, tower, guard: DecodeGuard):
    guard.restart()  # the clock runs from here, in the decode thread, not from the queue
    wave = decode_audio(data, tower.sample_rate, AudioLimits.of(ctx.settings), guard)
    if wave.numel() == 0:
        raise BadMedia("the audio has no samples")
    return tower.prepare(wave)


async def encode(ctx: EncodeContext, data: bytes, params: EncodeParams) -> torch.Tensor:
    tower = ctx.models.audio
    guard = DecodeGuard(ctx.settings.decode_timeout_s, "audio")
    try:
        with ctx.batcher.incoming():
            items = await ctx.in_pool(_prepare, ctx, data, tower, guard)
    except asyncio.CancelledError:
        guard.abandon()  # the decode thread stops at its next block
        raise
    outs = await ctx.batcher.gather([ctx.batcher.submit("audio", g) for g in items.groups])  # [K_g, rows, H]
    return items.kept(outs)  # [sum_k tokens_k, H]
