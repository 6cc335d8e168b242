"""No request hops to a worker thread for bookkeeping: FastAPI runs a plain ``def`` endpoint or
dependency in anyio's thread pool on every request (a context switch each time, and worker
threads that idle out after 10 s and are re-created, each with its own malloc arena: the RSS
drift a soak shows). Every route's endpoint and every dependency of all three services must be
``async``; work that does need a thread (decode, tokenize) is sent there explicitly."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterator
from typing import Annotated

import httpx
import pytest
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.routing import APIRoute

from mmserve.testing.fake_services import ServerThread, fake_encoder_app, fake_llm_app


def _is_async(call) -> bool:
    if inspect.iscoroutinefunction(call) or inspect.isasyncgenfunction(call):
        return True
    dunder = getattr(call, "__call__", None)
    return not inspect.isfunction(call) and (inspect.iscoroutinefunction(dunder) or inspect.isasyncgenfunction(dunder))


def _api_routes(routes) -> Iterator[APIRoute]:
    """Every ``APIRoute``, also inside included routers (FastAPI nests them)."""
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from _api_routes(inner.routes)


def _sync_calls(app: FastAPI) -> Iterator[str]:
    for route in _api_routes(app.routes):
        stack = [route.dependant]
        while stack:
            dep = stack.pop()
            if dep.call is not None and not _is_async(dep.call):
                yield f"{route.path}: {getattr(dep.call, '__qualname__', dep.call)}"
            stack.extend(dep.dependencies)


def _apps(tmp_path) -> dict[str, FastAPI]:
    from encoder_svc.app import create_app as encoder_app
    from gateway.app import create_app as gateway_app
    from llm_svc.front.app import create_app as llm_app
    from shared.settings import EncoderSettings, GatewaySettings, LLMSettings

    return {
        "gateway": gateway_app(GatewaySettings()),
        "encoder": encoder_app(EncoderSettings(model_dir=str(tmp_path))),
        "llm": llm_app(LLMSettings(model_dir=str(tmp_path))),
    }


def test_every_endpoint_and_dependency_is_async(tmp_path):
    apps = _apps(tmp_path)
    checked = {name: sum(1 for _ in _api_routes(app.routes)) for name, app in apps.items()}
    assert all(n >= 3 for n in checked.values()), checked  # the walk saw each service's routes
    offenders = [f"{name} {where}" for name, app in apps.items() for where in _sync_calls(app)]
    assert offenders == [], "sync endpoints/dependencies run in a worker thread per request: " + "; ".join(offenders)


def _sync_dep(request: Request) -> int:
    return 1


def test_the_check_catches_a_sync_dependency_in_an_included_router():
    router = APIRouter()

    @router.get("/x")
    async def x(v: Annotated[int, Depends(_sync_dep)]) -> int:
        return v

    app = FastAPI()
    app.include_router(router)
    assert list(_sync_calls(app)) == ["/x: _sync_dep"]


@pytest.fixture()
def gateway_over_http():
    from gateway.app import create_app
    from shared.settings import GatewaySettings

    with ServerThread(fake_encoder_app("enc")) as enc, ServerThread(fake_llm_app("llm")) as llm:
        settings = GatewaySettings(model_name="m", encoder_urls=[enc.url], llm_urls=[llm.url])
        with ServerThread(create_app(settings)) as gw:
            yield gw.url, settings.model_name


def test_serving_chats_starts_no_worker_thread(gateway_over_http):
    """Real HTTP through uvicorn: text, image and streamed chats leave no anyio worker thread
    behind (a sync dependency would have started one on the first request)."""
    from benchmarks._stack_util import image_part, make_png, user

    url, model = gateway_over_http
    before = {t.ident for t in threading.enumerate()}
    with httpx.Client(timeout=30) as c:
        for i in range(6):
            parts = [image_part(make_png(seed=i))] if i % 2 else []
            body = {"model": model, "max_tokens": 4, "stream": i % 3 == 0, "messages": [user(f"hi {i}", *parts)]}
            r = c.post(f"{url}/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
    new = [t.name for t in threading.enumerate() if t.ident not in before]
    assert not [n for n in new if "AnyIO worker" in n], new
