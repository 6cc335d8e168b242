"""video: sampled frames -> image path per frame -> temporal pooling -> [ceil(F/p) * T, H].

Decoded chunks are preprocessed and submitted to the batcher as they arrive, so frames of one
video share forwards with other requests and raw frames are dropped chunk by chunk.
"""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import Future

import torch

from encoder_svc.decode_limits import DecodeGuard
from encoder_svc.errors import BadMedia
from encoder_svc.modalities import mimo_vision
from encoder_svc.modalities.context import EncodeContext
from encoder_svc.video.plan import plan
from shared.schemas import EncodeParams, MediaSegment


def _fps_frames(ctx: EncodeContext, params: EncodeParams) -> tuple[float, int]:
    return params.fps or ctx.settings.video_fps, params.max_frames or ctx.settings.video_max_frames


def cache_signature(ctx: EncodeContext, params: EncodeParams) -> str:
    if ctx.models.takes_patches:
        return mimo_vision.video_signature(ctx, params)
    fps, max_frames = _fps_frames(ctx, params)
    pool = ctx.models.spec.vision.video_temporal_pool
    return f"vid:{fps:g}:{max_frames}:{pool}:{ctx.image_backend.name}:{ctx.models.image_cfg.signature()}"


def temporal_pool(frames: torch.Tensor, pool: int) -> torch.Tensor:
    """[F, T, H] -> [ceil(F / pool), T, H]: mean of consecutive groups, the last group padded
    by repeating the last frame."""
    f = frames.shape[0]
    groups = math.ceil(f / pool)
    pad = groups * pool - f
    if pad:
        frames = torch.cat([frames, frames[-1:].expand(pad, *frames.shape[1:])])
    return frames.reshape(groups, pool, *frames.shape[1:]).mean(dim=1)


def _decode_and_submit(ctx: EncodeContext, data: bytes, indices: list[int], guard: DecodeGuard) -> list[Future]:
    futures: list[Future] = []
    try:
        for _, frames in ctx.video_decoder.iter_chunks(data, indices, guard):
            guard.raise_if_stopped()  # another chunk passed a budget, or the encode was cancelled
            pixels = ctx.image_backend.frames(frames)  # [n, 3, h, w]
            del frames
            futures.append(ctx.batcher.submit("vision", pixels))
        guard.raise_if_stopped()  # cancelled while decoding: queue nothing for it
    except BaseException:
        for f in futures:
            f.cancel()
        raise
    return futures


async def segments(ctx: EncodeContext, data: bytes, params: EncodeParams,
                   embeds: torch.Tensor) -> list[MediaSegment] | None:
    """Timestamped runs of the rows (MiMo-V2.5 layout), or None: one run."""
    if ctx.models.takes_patches:
        return await mimo_vision.video_segments(ctx, data, params, embeds)
    return None


async def encode(ctx: EncodeContext, data: bytes, params: EncodeParams) -> torch.Tensor:
    if ctx.models.takes_patches:  # MiMo-V2.5: temporal groups of 2 frames, size-dependent tokens
        return await mimo_vision.encode_video(ctx, data, params)
    with ctx.batcher.incoming():
        guard, _, indices = await ctx.in_pool(plan, ctx.settings, ctx.video_decoder, data, *_fps_frames(ctx, params))
    try:
        with ctx.batcher.incoming():  # later chunks of this video may join earlier ones' batch
            futures = await ctx.in_pool(_decode_and_submit, ctx, data, indices, guard)
        outs = await ctx.batcher.gather(futures)
    except asyncio.CancelledError:
        guard.abandon()  # the decode thread stops at its next check
        raise
    per_frame = torch.cat(outs)  # [F, T, H]
    if per_frame.shape[0] != len(indices):
        raise BadMedia(f"decoded {per_frame.shape[0]} of {len(indices)} sampled frames")
    pooled = temporal_pool(per_frame, ctx.models.spec.vision.video_temporal_pool)
    return pooled.reshape(-1, per_frame.shape[-1])  # [ceil(F/p) * T, H]
