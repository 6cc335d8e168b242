"""``create_app(settings)``: the LLM service (POST /v1/generate, health, readiness, metrics)."""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from shared.service_auth import ServiceTokenMiddleware
from shared.malloc_tuning import pin_mmap_threshold
from shared.settings import LLMSettings

from .errors import error_body
from .routes import router
from .tokenize_routes import router as tokenize_router
from .state import ServiceState


def create_app(settings: LLMSettings) -> FastAPI:
    """Build the app; the model loads in the background at start-up (``/readyz`` says when)."""
    state = ServiceState(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        pin_mmap_threshold(settings.malloc_mmap_threshold)  # this process only: the core is its own
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
    app.include_router(router)
    app.include_router(tokenize_router)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(status_code=400, content=error_body(str(exc)))

    return app
