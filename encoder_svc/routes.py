"""HTTP routes: ``POST /v1/encode``, ``GET /v1/embeddings/{key}``, health, readiness, metrics."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from encoder_svc.batching import encode_deadline
from encoder_svc.decode_limits import video_pixel_share
from encoder_svc.disconnect import unless_disconnected
from encoder_svc.errors import BadMedia, Busy, EncodeTimeout, MediaTooLarge, NotReady, error_body
from encoder_svc.service import EncoderService, split_key
from shared.admission import Overloaded, deadline_from
from shared.bounded_read import TooLarge, read_bounded
from shared.schemas import EncodeParams, EncodeResult, HealthStatus
from shared.video_budget import VIDEO_PIXEL_SHARE_HEADER, parse_share
from shared.wire import SAFETENSORS_MIME, pack

router = APIRouter()


async def get_service(request: Request) -> EncoderService:
    svc = getattr(request.app.state, "service", None)
    if svc is None:
        raise NotReady("the encoder is still loading its model; retry shortly")
    return svc


ServiceDep = Annotated[EncoderService, Depends(get_service)]


def _params(request: Request) -> EncodeParams:
    query = dict(request.query_params)
    try:
        return EncodeParams.model_validate(query)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "query"
        raise BadMedia(f"invalid query parameter {where}: {first['msg']}", param=where) from e


def _wire(embeds, result: EncodeResult, key: str | None = None) -> Response:
    """By reference (``result.by_ref``): the JSON header alone; else safetensors with the tensor."""
    headers = {"x-mmserve-cache-key": key} if key else None
    if key:
        result = result.model_copy(update={"key": key})
    if result.by_ref:
        return JSONResponse(result.model_dump(), headers=headers)
    return Response(pack({"embeds": embeds}, result), media_type=SAFETENSORS_MIME, headers=headers)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``limit`` (never buffered)."""
    try:
        return await read_bounded(request.stream(), limit, request.headers.get("content-length"))
    except TooLarge as e:
        if e.declared is not None:
            raise MediaTooLarge(f"media is {e.declared} bytes; the limit is {limit} bytes") from None
        raise MediaTooLarge(f"media is over the limit of {limit} bytes") from None


@router.post("/v1/encode")
async def encode(request: Request, svc: ServiceDep) -> Response:
    params = _params(request)
    deadline = deadline_from(request.headers)
    if deadline is not None and deadline <= time.monotonic():
        svc.metrics.deadline_drops.inc()
        raise EncodeTimeout("the request's deadline passed before it arrived; not encoded")
    try:
        ticket = await svc.admission.acquire()
    except Overloaded as e:
        svc.metrics.overload_rejections.inc()
        raise Busy(e.message, e.retry_after) from None
    token = encode_deadline.set(deadline)  # the batcher drops this request's items past it
    share = video_pixel_share.set(parse_share(request.headers.get(VIDEO_PIXEL_SHARE_HEADER)))
    try:
        with svc.ctx.batcher.incoming():  # a request still arriving may join the next batch
            body = await _read_body(request, svc.ctx.settings.max_media_bytes)
        embeds, result = await unless_disconnected(request, svc.encode(params, body))
    finally:
        video_pixel_share.reset(share)
        encode_deadline.reset(token)
        ticket.release()
    return _wire(embeds, result, svc.cache_key(params, result.content_hash))


@router.get("/v1/embeddings/{key:path}")
async def cached_embedding(key: str, request: Request, svc: ServiceDep) -> Response:
    """A cached embedding: ``key`` is a full cache key (``x-mmserve-cache-key`` of an encode
    response) or a content hash with the encode query (``?modality=image[&fps=..]``)."""
    if split_key(key) is None:
        params = _params(request)
        if params.modality not in svc.supported():
            raise BadMedia(f"modality {params.modality!r} is not supported by this model", param="modality")
        key = svc.cache_key(params, key.lower())
    embeds = await svc.lookup(key)
    found, segments = await svc.lookup_segments(key)
    if embeds is None or not found:
        return JSONResponse(error_body(f"no cached embedding for key {key!r}", "not_found_error"), status_code=404)
    _, modality, _, digest = split_key(key)  # type: ignore[misc]
    result = EncodeResult(
        modality=modality, content_hash=digest, model=svc.model_name,
        num_tokens=embeds.shape[0], hidden_size=embeds.shape[1], cached=True, segments=segments,
    )
    return _wire(embeds, result, key)


@router.get("/healthz")
async def healthz() -> HealthStatus:
    return HealthStatus(status="ok", service="encoder")


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    svc = getattr(request.app.state, "service", None)
    err = getattr(request.app.state, "load_error", None)
    # what this encoder leaves open (no service token beyond loopback), naming the setting
    warnings = {"warnings": getattr(request.app.state, "exposure_warnings", [])}
    if svc is None:
        st = HealthStatus(status="error" if err else "loading", service="encoder", detail=err)
        return JSONResponse({**st.model_dump(), **warnings}, status_code=503)
    st = HealthStatus(status="ok", service="encoder", model=svc.model_name, detail=",".join(svc.supported()))
    return JSONResponse({**st.model_dump(), **warnings})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
