"""A gzip bomb fetched by URL through the gateway, over real HTTP: refused by its decoded size
(max_media_bytes) while it inflates, never inflated whole; the gateway serves the next request."""

from __future__ import annotations

import io
import tracemalloc
import zlib

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import Response
from PIL import Image

from gateway.app import create_app
from mmserve.testing.fake_services import ServerThread, fake_encoder_app, fake_llm_app
from shared.settings import GatewaySettings

pytestmark = pytest.mark.integration

LIMIT = 1 << 20  # max_media_bytes of the gateway under test


def gzip_zeros(n: int) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    block = bytes(1 << 20)
    return b"".join(c.compress(block) for _ in range(n >> 20)) + c.flush()


def png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (0, 128, 0)).save(buf, "PNG")
    return buf.getvalue()


def encoded_media_app(files: dict[str, tuple[bytes, str]]) -> FastAPI:
    """Serves ``files[name] = (body, content_encoding)`` as sent, with that Content-Encoding."""
    app = FastAPI()

    @app.get("/files/{name}")
    async def get(name: str) -> Response:
        body, encoding = files[name]
        headers = {"content-encoding": encoding} if encoding else {}
        return Response(body, media_type="image/png", headers=headers)

    return app


@pytest.fixture(scope="module")
def stack():
    bomb = gzip_zeros(1 << 30)  # 1 GiB of zeros in about 1 MiB
    files = {"bomb.png": (bomb, "gzip"), "ok.png": (zlib.compress(png()), "deflate"), "plain.png": (png(), "")}
    enc = ServerThread(fake_encoder_app("e")).start()
    llm = ServerThread(fake_llm_app("l")).start()
    media = ServerThread(encoded_media_app(files)).start()
    s = GatewaySettings(model_name="m", encoder_urls=[enc.url], llm_urls=[llm.url], allowed_hosts=["127.0.0.1"],
                        max_media_bytes=LIMIT, health_interval=0, dns_interval=0)
    gw = ServerThread(create_app(s)).start()
    client = httpx.Client(base_url=gw.url, timeout=60)
    yield client, media.url, bomb
    client.close()
    for t in (gw, media, llm, enc):
        t.stop()


def chat(url: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}


def test_gzip_bomb_by_url_refused_by_decoded_bytes(stack):
    client, media, bomb = stack
    assert len(bomb) < 2 * LIMIT
    tracemalloc.start()
    try:
        r = client.post("/v1/chat/completions", json=chat(f"{media}/files/bomb.png"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert f"after gzip decoding (max_media_bytes={LIMIT})" in msg, msg
    # every process here together: the bomb's compressed body, one capped inflate, the servers; inflating
    # one 64 KiB socket read whole would be 64 MiB
    assert peak < 24 << 20, f"peak {peak} bytes traced while refusing a bomb capped at {LIMIT}"


@pytest.mark.parametrize("name", ["ok.png", "plain.png"])
def test_encoded_and_plain_media_still_served(stack, name):
    client, media, _ = stack
    r = client.post("/v1/chat/completions", json=chat(f"{media}/files/{name}"))
    assert r.status_code == 200, r.text
