import asyncio

import httpx
import pytest
from fastapi import FastAPI, Request

from gateway.errors import install_error_handlers
from gateway.limits import BodyLimitMiddleware, body_limit

pytestmark = pytest.mark.unit


def app_with_limit(limit: int) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"n": len(await request.body())}

    app.add_middleware(BodyLimitMiddleware, limit=limit)
    return app


def post(app: FastAPI, content) -> httpx.Response:
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            return await c.post("/echo", content=content)

    return asyncio.run(main())


def test_small_body_passes():
    assert post(app_with_limit(10), b"x" * 10).json() == {"n": 10}


def test_declared_length_over_limit_is_413():
    r = post(app_with_limit(10), b"x" * 11)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_chunked_body_over_limit_is_413():
    async def chunks():
        for _ in range(5):
            yield b"x" * 4

    r = post(app_with_limit(10), chunks())
    assert r.status_code == 413 and "exceeds 10 bytes" in r.json()["error"]["message"]


def test_limit_leaves_room_for_base64_media():
    assert body_limit(3 * 1024 * 1024) > 4 * 1024 * 1024

