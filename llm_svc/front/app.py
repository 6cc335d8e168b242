"""``create_app(settings)``: the LLM service (POST /v1/generate, health, readiness, metrics)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from shared.exposure import log_warnings, service_token_warnings
from shared.service_auth import ServiceTokenMiddleware
from shared.malloc_tuning import pin_mmap_threshold
from shared.settings import LLMSettings

from llm_svc.types.errors import error_body
from .kernels import KernelStatus
from .routes import router
from .tokenize_routes import router as tokenize_router
from .state import ServiceState

log = logging.getLogger(__name__)


def create_app(settings: LLMSettings) -> FastAPI:
    """Build the app; the model loads in the background at start-up (``/readyz`` says when)."""
    if settings.role != "both" and settings.backend != "swa":
        # the hand-over runs in the engine core (llm_svc/disagg, docs/disagg.md)
        raise ValueError(f"role {settings.role!r} needs the engine core: --backend swa (docs/disagg.md)")
    if settings.role != "both" and settings.tensor_parallel_size > 1:
        raise ValueError(f"role {settings.role!r} with tensor_parallel_size > 1 is not served yet: each rank holds "
                         "its heads' share of the KV, and the hand-over moves one rank's (docs/disagg.md)")
    state = ServiceState(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        pin_mmap_threshold(settings.malloc_mmap_threshold)  # this process only: the core is its own
        log_warnings(log, app.state.exposure_warnings)
        task = asyncio.create_task(state.load())
        try:
            yield
        finally:
            await task
            await state.close()

    app = FastAPI(title="mmserve llm", lifespan=lifespan)
    if settings.service_token:
        app.add_middleware(ServiceTokenMiddleware, token=settings.service_token)
    app.state.svc = state
    app.state.kernels = KernelStatus(state.metrics.registry)  # /readyz, /metrics: which C kernels loaded
    app.state.exposure_warnings = service_token_warnings(  # logged at start, listed on /readyz
        settings.host, settings.service_token, "MMSERVE_LLM_", "LLM service",
        "/v1/generate, /tokenize and the KV snapshot answer any caller")
    app.include_router(router)
    app.include_router(tokenize_router)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(status_code=400, content=error_body(str(exc)))

    return app
