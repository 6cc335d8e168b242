"""The gateway app: ``create_app(settings)`` is the one entry point (the CLI serves it with
uvicorn).  Per-app objects are built in the lifespan and reached through ``StateDep``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from gateway.errors import install_error_handlers
from gateway.edge.door import ApiKeyMiddleware
from gateway.exposure import log_exposure
from gateway.edge.limits import AdmissionMiddleware, BodyLimit, BodyLimitMiddleware, body_limit
from gateway.metrics import GatewayMetrics, MetricsMiddleware
from gateway.openapi import install_openapi
from gateway.routes import chat, completions, dashboard, health, models, responses, tokenize
from gateway.state import GatewayState
from shared.gc_tuning import freeze_startup_heap, thaw_heap
from shared.malloc_tuning import pin_mmap_threshold
from shared.settings import GatewaySettings


# generations: an admission slot each, taken before the body is read
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})


def body_limits(settings: GatewaySettings) -> dict:
    """``BodyLimitMiddleware``'s arguments: the media budget where media may come inline (chat,
    responses), ``max_text_body_bytes`` everywhere else."""
    media = BodyLimit(body_limit(settings.max_request_media_bytes), "max_request_media_bytes")
    return {"limits": {"/v1/chat/completions": media, "/v1/responses": media},
            "default": BodyLimit(settings.max_text_body_bytes, "max_text_body_bytes")}


def create_app(settings: GatewaySettings) -> FastAPI:
    """A FastAPI app serving the OpenAI chat subset in front of the encoder and LLM replicas."""
    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        pin_mmap_threshold(settings.malloc_mmap_threshold)
        log_exposure(settings)
        state = GatewayState.build(settings, metrics)
        app.state.gateway = state
        state.start()
        freeze_startup_heap("gateway")
        try:
            yield
        finally:
            thaw_heap()
            await state.close()

    app = FastAPI(title="mmserve gateway", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    install_openapi(app)
    paths: set[str] = set()
    for module in (chat, completions, responses, models, tokenize, health, dashboard):
        app.include_router(module.router)
        paths.update(getattr(r, "path", "") for r in module.router.routes)
    # pure ASGI, outermost first: metrics (every answer counted), the API key (401 before the
    # body is read), the body size per endpoint (413), the admission slot (429) before the body
    # is read or parsed; add_middleware puts each call outside the ones before it
    app.add_middleware(AdmissionMiddleware, state_of=lambda: getattr(app.state, "gateway", None),
                       paths=GENERATION_PATHS, on_shed=metrics.rejected.labels("gateway").inc)
    app.add_middleware(BodyLimitMiddleware, **body_limits(settings))
    app.add_middleware(ApiKeyMiddleware, keys=settings.api_keys)
    app.add_middleware(MetricsMiddleware, metrics=metrics, routes=frozenset(paths))
    app.state.metrics = metrics
    return app


def run(settings: GatewaySettings) -> None:
    """Serve the gateway with uvicorn on ``settings.host:settings.port`` (blocks)."""
    import uvicorn

    uvicorn.run(
        create_app(settings), host=settings.host, port=settings.port,
        log_level=settings.log_level, timeout_graceful_shutdown=5, timeout_keep_alive=settings.keep_alive_timeout,
    )
