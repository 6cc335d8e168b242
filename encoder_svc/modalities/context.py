"""What a modality pipeline may use: the loaded models, the batcher, the CPU pool, settings."""

from __future__ import annotations

import asyncio
import contextvars
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, TypeVar

from encoder_svc.batching import Batcher
from encoder_svc.models.loader import LoadedModels
from encoder_svc.preprocess.image import ImageBackend
from encoder_svc.video.decode import ChunkedVideoDecoder
from shared.settings import EncoderSettings

T = TypeVar("T")


@dataclass
class EncodeContext:
    settings: EncoderSettings
    models: LoadedModels
    batcher: Batcher
    cpu_pool: ThreadPoolExecutor  # decode/preprocess work, off the event loop
    image_backend: ImageBackend | None
    video_decoder: ChunkedVideoDecoder | None = None

    async def in_pool(self, fn: Callable[..., T], *args) -> T:
        ctx = contextvars.copy_context()  # the request's deadline reaches the batcher from the pool
        return await asyncio.get_running_loop().run_in_executor(self.cpu_pool, ctx.run, fn, *args)
