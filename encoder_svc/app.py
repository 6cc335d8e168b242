"""``create_app(settings)``: the encoder service's FastAPI app; models load in the lifespan."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI

from encoder_svc.batching import BatchConfig, Batcher
from encoder_svc.cache.factory import build_cache
from encoder_svc.errors import EncodeError, encode_error_handler, unexpected_error_handler
from encoder_svc.metrics import EncoderMetrics
from encoder_svc.models.loader import LoadedModels, load_models
from encoder_svc.modalities.context import EncodeContext
from encoder_svc.preprocess.image import make_image_backend
from encoder_svc.routes import router
from encoder_svc.service import EncoderService
from encoder_svc.video.decode import ChunkedVideoDecoder
from shared.gc_tuning import freeze_startup_heap, thaw_heap
from shared.service_auth import ServiceTokenMiddleware
from shared.bundle import load_bundle_spec
from shared.cpus import usable_cpus
from shared.settings import EncoderSettings
from shared.exposure import log_warnings, service_token_warnings

log = logging.getLogger(__name__)


def build_service(settings: EncoderSettings, metrics: EncoderMetrics, models: LoadedModels | None = None,
                  cache_opts: dict | None = None) -> EncoderService:
    """Everything but HTTP: models, batcher, preprocessing, cache (blocking; call off-loop).

    ``cache_opts`` go to ``build_cache`` (``shm_dir``, ``redis_prefix``): tests and benchmarks
    isolate their cache namespaces with them."""
    if models is None:
        models = load_models(load_bundle_spec(settings.model_dir), settings.device, settings.dtype)

    def forward(encoder: str, x):
        model = models.vision if encoder == "vision" else models.audio
        return model(x.to(models.device))

    batcher = Batcher(
        BatchConfig(settings.max_batch_size, settings.max_wait_ms, settings.request_timeout), forward, metrics
    )
    backend = None
    if models.image_cfg is not None:
        backend = make_image_backend(settings.image_backend, models.image_cfg, models.device, settings.max_image_pixels)
    elif models.takes_patches and settings.image_backend != "torchvision":
        log.warning("image_backend=%s does not apply to the MiMo-V2.5 ViT: it decodes with torchvision (nvJPEG on "
                    "CUDA) and resizes as its published processor does", settings.image_backend)
    pool = ThreadPoolExecutor(max_workers=max(2, usable_cpus()), thread_name_prefix="encoder-cpu")
    video = None
    if models.vision is not None:
        video = ChunkedVideoDecoder(settings.video_backend, settings.video_workers)
    ctx = EncodeContext(settings, models, batcher, pool, backend, video)
    return EncoderService(ctx, metrics, build_cache(settings, metrics, **(cache_opts or {})))


def create_app(settings: EncoderSettings, *, shm_dir: str | None = None, redis_prefix: str | None = None) -> FastAPI:
    """The encoder app; the model loads in the lifespan (``/readyz`` is 503 until then)."""
    metrics = EncoderMetrics()
    cache_opts = {k: v for k, v in (("shm_dir", shm_dir), ("redis_prefix", redis_prefix)) if v is not None}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        log_warnings(log, app.state.exposure_warnings)
        try:
            app.state.service = await asyncio.to_thread(build_service, settings, metrics, None, cache_opts)
        except Exception as e:
            app.state.load_error = f"{type(e).__name__}: {e}"
            log.exception("encoder failed to load %s", settings.model_dir)
            raise
        freeze_startup_heap("encoder")
        try:
            yield
        finally:
            thaw_heap()
            svc, app.state.service = app.state.service, None
            if svc.cache is not None:
                await svc.cache.close()
            svc.close()

    app = FastAPI(title="mmserve encoder", lifespan=lifespan)
    if settings.service_token:
        app.add_middleware(ServiceTokenMiddleware, token=settings.service_token)
    app.state.metrics = metrics
    app.state.service = None
    app.state.load_error = None
    app.state.exposure_warnings = service_token_warnings(  # logged at start, listed on /readyz
        settings.host, settings.service_token, "MMSERVE_ENCODER_", "encoder",
        "/v1/encode and the embedding cache answer any caller")
    app.add_exception_handler(EncodeError, encode_error_handler)
    app.add_exception_handler(Exception, unexpected_error_handler)
    app.include_router(router)
    return app
