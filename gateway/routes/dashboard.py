"""``GET /dashboard`` (a page), ``GET /dashboard/data`` (the JSON it polls), and the page's
vendored static files (uPlot, MIT, from npm: no CDN, the machines are offline). With API keys
set, the data needs one (it shows replica addresses, queues and cache figures); the page and
the static files (a vendored library, the page's script) hold no data and do not."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, JSONResponse, Response

from gateway.edge.auth import DashboardKeyDep
from gateway.dashboard import snapshot
from gateway.errors import APIError
from gateway.exposure import exposure_warnings
from gateway.state import StateDep

router = APIRouter()
STATIC = Path(__file__).resolve().parents[1] / "static"
_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html", ".LICENSE": "text/plain"}
_FILES = {p.name: p for p in STATIC.iterdir() if p.suffix in _TYPES} if STATIC.is_dir() else {}


@router.get("/dashboard")
async def dashboard_page() -> Response:
    """The page (no data in it: with API keys set it asks for one, or takes it from the URL
    fragment, ``/dashboard#key=...``, and sends it as a bearer header to ``/dashboard/data``)."""
    return FileResponse(STATIC / "dashboard.html", media_type="text/html")


@router.get("/dashboard/data", dependencies=[DashboardKeyDep])
async def dashboard_data(state: StateDep) -> JSONResponse:
    """Every replica's /metrics, scraped now and reduced (``gateway.dashboard``), with the
    gateway's and the replicas' open-by-default warnings."""
    prefill = state.llms.pairing.pool.replicas() if state.llms.pairing is not None else []  # docs/disagg.md
    snap = await snapshot(state.http, [*state.llm_pool.replicas(), *prefill], state.encoder_pool.replicas(),
                          state.metrics.render().decode(), gateway_warnings=exposure_warnings(state.settings))
    return JSONResponse(snap.to_json(), headers={"cache-control": "no-store"})


@router.get("/dashboard/static/{name}")
async def dashboard_static(name: str) -> Response:
    path = _FILES.get(name)
    if path is None:
        raise APIError(404, f"no dashboard file {name!r}", param="name", code="not_found")
    return FileResponse(path, media_type=_TYPES[path.suffix])
