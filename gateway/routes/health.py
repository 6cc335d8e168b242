"""Liveness, readiness and metrics (never behind API keys)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from gateway.exposure import exposure_warnings
from gateway.state import StateDep
from shared.schemas import HealthStatus

router = APIRouter()


@router.get("/healthz")
async def healthz(state: StateDep) -> HealthStatus:
    """The process is alive."""
    return HealthStatus(status="ok", service="gateway", model=state.model_name)


@router.get("/health")
async def health(state: StateDep) -> HealthStatus:
    """Alias of /healthz for load clients that probe ``GET /health`` (guidellm, vLLM's path)."""
    return await healthz(state)


@router.get("/readyz")
async def readyz(state: StateDep) -> JSONResponse:
    """200 when at least one encoder and one LLM replica answer their /readyz now (no encoder
    configured: a text-only model, the LLM replicas alone). ``warnings``: what this gateway
    leaves open (``gateway.exposure``), each naming the setting that closes it."""
    enc_ok, llm_ok = await asyncio.gather(state.encoder_pool.any_ready(), state.llm_pool.any_ready())
    enc_ok = enc_ok or not state.settings.encoder_urls
    warnings = exposure_warnings(state.settings)
    if enc_ok and llm_ok:
        body = HealthStatus(status="ok", service="gateway", model=state.model_name)
        return JSONResponse({**body.model_dump(), "warnings": warnings}, status_code=200)
    missing = [name for name, ok in (("encoder", enc_ok), ("llm", llm_ok)) if not ok]
    body = HealthStatus(
        status="loading", service="gateway", model=state.model_name,
        detail=f"no ready {' or '.join(missing)} replica",
    )
    return JSONResponse({**body.model_dump(), "warnings": warnings}, status_code=503)


@router.get("/metrics")
async def metrics(state: StateDep) -> Response:
    return Response(state.metrics.render(), media_type=state.metrics.CONTENT_TYPE)
