"""image: bytes -> backend preprocessing [1, 3, h, w] -> vision encoder -> [tokens_per_image, H]."""

from __future__ import annotations

import torch

from encoder_svc.modalities.context import EncodeContext
from shared.schemas import EncodeParams


def cache_signature(ctx: EncodeContext, params: EncodeParams) -> str:
    return f"img:{ctx.image_backend.name}:{ctx.models.image_cfg.signature()}"


async def encode(ctx: EncodeContext, data: bytes, params: EncodeParams) -> torch.Tensor:
    with ctx.batcher.incoming():
        pixels = await ctx.in_pool(ctx.image_backend.images, [data])  # [1, 3, h, w]
    out = await ctx.batcher.run("vision", pixels)  # [1, T, H]
    return out[0]
