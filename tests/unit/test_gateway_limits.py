import asyncio

import httpx
import pytest
from fastapi import FastAPI, Request

from gateway.app import body_limits
from gateway.errors import install_error_handlers
from gateway.edge.limits import BodyLimit, BodyLimitMiddleware, body_limit
from shared.settings import GatewaySettings

pytestmark = pytest.mark.unit

SMALL = BodyLimit(10, "max_text_body_bytes")


def app_with_limit(limit: int, per_path: dict[str, BodyLimit] | None = None) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"n": len(await request.body())}

    @app.post("/media")
    async def media(request: Request) -> dict:
        return {"n": len(await request.body())}

    app.add_middleware(BodyLimitMiddleware, limits=per_path or {}, default=BodyLimit(limit, "max_text_body_bytes"))
    return app


def post(app, content, path: str = "/echo") -> httpx.Response:
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            return await c.post(path, content=content)

    return asyncio.run(main())


async def chunks(n: int, size: int = 4):
    for _ in range(n):
        yield b"x" * size


def test_small_body_passes():
    assert post(app_with_limit(10), b"x" * 10).json() == {"n": 10}


def test_declared_length_over_limit_is_413_naming_the_setting():
    r = post(app_with_limit(10), b"x" * 11)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert "max_text_body_bytes (MMSERVE_GATEWAY_MAX_TEXT_BODY_BYTES)" in r.json()["error"]["message"]


def test_chunked_body_over_limit_is_a_413_json_error_not_a_500():
    # the limit trips inside receive(), while FastAPI reads the body: the 413 must come out
    # through the error handlers as an OpenAI error, and the connection is not kept for a drain
    r = post(app_with_limit(10), chunks(5))
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
    assert "exceeds 10 bytes" in err["message"] and "max_text_body_bytes" in err["message"]
    assert r.headers["connection"] == "close"


def test_limit_is_per_path():
    app = app_with_limit(10, {"/media": BodyLimit(100, "max_request_media_bytes")})
    assert post(app, b"x" * 50, "/media").json() == {"n": 50}
    assert post(app, chunks(20), "/media").json() == {"n": 80}
    r = post(app, b"x" * 50, "/echo")
    assert r.status_code == 413 and "max_text_body_bytes" in r.json()["error"]["message"]
    r = post(app, b"x" * 101, "/media")
    assert r.status_code == 413 and "max_request_media_bytes" in r.json()["error"]["message"]


def test_an_app_reading_the_body_outside_fastapi_still_gets_a_413():
    async def raw(scope, receive, send):  # reads the whole body itself, as a plain ASGI app would
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"read"})

    app = BodyLimitMiddleware(raw, limits={}, default=SMALL)
    r = post(app, chunks(5))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert post(app, chunks(2)).text == "read"


def test_gateway_limits_media_paths_take_the_media_budget_and_the_rest_the_text_limit():
    s = GatewaySettings(max_request_media_bytes=3 * 1024 * 1024, max_text_body_bytes=1024 * 1024)
    kw = body_limits(s)
    for path in ("/v1/chat/completions", "/v1/responses"):
        assert kw["limits"][path] == BodyLimit(body_limit(3 * 1024 * 1024), "max_request_media_bytes")
    assert "/v1/completions" not in kw["limits"] and "/tokenize" not in kw["limits"]
    assert kw["default"] == BodyLimit(1024 * 1024, "max_text_body_bytes")
    assert body_limit(3 * 1024 * 1024) > 4 * 1024 * 1024 > kw["default"].max_bytes  # room for base64 media
