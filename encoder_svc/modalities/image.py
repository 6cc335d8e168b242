"""image: bytes -> backend preprocessing [1, 3, h, w] -> vision encoder -> [tokens_per_image, H]."""

from __future__ import annotations

import torch

from encoder_svc.modalities import mimo_vision
from encoder_svc.modalities.context import EncodeContext
from shared.schemas import EncodeParams


def cache_signature(ctx: EncodeContext, params: EncodeParams) -> str:
    if ctx.models.takes_patches:
        return mimo_vision.image_signature(ctx, params)
    return f"img:{ctx.image_backend.name}:{ctx.models.image_cfg.signature()}"


async def encode(ctx: EncodeContext, data: bytes, params: EncodeParams) -> torch.Tensor:
    if ctx.models.takes_patches:  # MiMo-V2.5: size-dependent token count
        return await mimo_vision.encode_image(ctx, data, params)
    with ctx.batcher.incoming():
        pixels = await ctx.in_pool(ctx.image_backend.images, [data])  # [1, 3, h, w]
    out = await ctx.batcher.run("vision", pixels)  # [1, T, H]
    return out[0]
