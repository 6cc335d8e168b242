"""image / video for the MiMo-V2.5 ViT (``VisionSpec.kind == "mimo_omni"``): dynamic resolution.

* image: decode (nvJPEG on CUDA) -> ``smart_resize`` + normalize on the device -> one temporal
  group ``[1, lh, lw, m*m, P]`` -> batcher -> ``[lh*lw, H]``: the token count follows the size.
* video: ``F`` frames sampled as for every tower (``video/sampling.py``), decoded chunk by chunk;
  frames are paired into temporal groups across chunk boundaries (the last one repeated when
  ``F`` is odd), each group is one batcher item ``[lh, lw, m*m, P]`` -> ``[G * lh*lw, H]``.
  ``segments`` gives, per group, the time of its first frame (``index / native fps``) and its
  token count: the LLM writes ``MM:SS`` before each group (vLLM's ``MiMoVLProcessor`` layout).

Items of equal grid batch together across requests (the batcher groups by input shape, and the
shape carries the grid); the cache signature carries every preprocessing parameter.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

import torch

from encoder_svc.decode_limits import DecodeGuard
from encoder_svc.errors import BadMedia
from encoder_svc.modalities.context import EncodeContext
from encoder_svc.preprocess.image_decode import decode_rgb
from encoder_svc.video.plan import plan
from shared.schemas import EncodeParams, MediaSegment


def _fps_frames(ctx: EncodeContext, params: EncodeParams) -> tuple[float, int]:
    return params.fps or ctx.settings.video_fps, params.max_frames or ctx.settings.video_max_frames


def image_signature(ctx: EncodeContext, params: EncodeParams) -> str:
    return f"img:{ctx.models.vision.preprocess.signature()}"


def video_signature(ctx: EncodeContext, params: EncodeParams) -> str:
    fps, max_frames = _fps_frames(ctx, params)
    return f"vid:{fps:g}:{max_frames}:{ctx.video_decoder.backend}:{ctx.models.vision.preprocess.signature()}"


def _image_patches(ctx: EncodeContext, data: bytes) -> torch.Tensor:
    img = decode_rgb(data, ctx.settings.max_image_pixels, ctx.models.device)
    return ctx.models.vision.preprocess.image(img)  # [1, lh, lw, m*m, P]


async def encode_image(ctx: EncodeContext, data: bytes, params: EncodeParams) -> torch.Tensor:
    with ctx.batcher.incoming():
        patches = await ctx.in_pool(_image_patches, ctx, data)
    out = await ctx.batcher.run("vision", patches)  # [1, lh*lw, H]
    return out[0]


def _sampled(ctx: EncodeContext, data: bytes, params: EncodeParams):
    _, info, indices = plan(ctx.settings, ctx.video_decoder, data, *_fps_frames(ctx, params))
    return info, indices


def _decode_and_submit(ctx: EncodeContext, data: bytes, info, indices: list[int], guard: DecodeGuard) -> list[Future]:
    pre = ctx.models.vision.preprocess
    tp = pre.temporal_patch
    size = pre.video_size(info.height, info.width, len(indices))
    futures: list[Future] = []
    carry: torch.Tensor | None = None  # frames of an unfinished temporal group
    try:
        for _, frames in ctx.video_decoder.iter_chunks(data, indices, guard):
            guard.raise_if_stopped()  # another chunk passed a budget, or the encode was cancelled
            frames = frames.to(ctx.models.device, non_blocking=True)
            if carry is not None:
                frames = torch.cat([carry, frames])
            whole = frames.shape[0] // tp * tp
            carry = frames[whole:] if whole < frames.shape[0] else None
            if whole:
                futures.append(ctx.batcher.submit("vision", pre.video(frames[:whole], size)))  # [g, lh, lw, m*m, P]
            del frames
        if carry is not None:  # vLLM: pad by repeating the last frame
            pad = carry[-1:].expand(tp - carry.shape[0], *carry.shape[1:])
            futures.append(ctx.batcher.submit("vision", pre.video(torch.cat([carry, pad]), size)))
        guard.raise_if_stopped()  # cancelled while decoding: queue nothing for it
    except BaseException:
        for f in futures:
            f.cancel()
        raise
    return futures


async def encode_video(ctx: EncodeContext, data: bytes, params: EncodeParams) -> torch.Tensor:
    with ctx.batcher.incoming():
        guard, info, indices = await ctx.in_pool(plan, ctx.settings, ctx.video_decoder, data, *_fps_frames(ctx, params))
    try:
        with ctx.batcher.incoming():
            futures = await ctx.in_pool(_decode_and_submit, ctx, data, info, indices, guard)
        outs = await ctx.batcher.gather(futures)
    except asyncio.CancelledError:
        guard.abandon()  # the decode thread stops at its next check
        raise
    groups = torch.cat(outs)  # [G, lh*lw, H]
    tp = ctx.models.vision.preprocess.temporal_patch
    if groups.shape[0] != -(-len(indices) // tp):
        raise BadMedia(f"decoded {groups.shape[0]} of {-(-len(indices) // tp)} temporal groups of the video")
    return groups.reshape(-1, groups.shape[-1])  # [G * lh*lw, H]


async def video_segments(ctx: EncodeContext, data: bytes, params: EncodeParams,
                         embeds: torch.Tensor) -> list[MediaSegment]:
    """Per temporal group: the time of its first sampled frame and its tokens (equal per group)."""
    info, indices = await ctx.in_pool(_sampled, ctx, data, params)
    tp = ctx.models.vision.preprocess.temporal_patch
    starts = indices[::tp]
    if embeds.shape[0] % len(starts):
        raise BadMedia(f"{embeds.shape[0]} video tokens do not split into {len(starts)} temporal groups")
    per = embeds.shape[0] // len(starts)
    fps = info.fps if info.fps > 0 else 1.0
    return [MediaSegment(start_s=i / fps, num_tokens=per) for i in starts]
