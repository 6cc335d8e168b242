"""Remote media (http URLs, redirects, SSRF guard, limits), API keys and client disconnects."""

import io
import json
import socket
import time

import httpx
import pytest
from PIL import Image

from gateway.app import create_app
from mmserve.testing.fake_services import ServerThread, fake_encoder_app, fake_llm_app, media_server_app
from shared.settings import GatewaySettings

pytestmark = pytest.mark.integration

MODEL = "m"
KEY = "sk-test-123"


def png(size=(8, 8)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (0, 128, 0)).save(buf, "PNG")
    return buf.getvalue()


def chat(*parts, **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": list(parts)}], **kw}


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def stack():
    enc = ServerThread(fake_encoder_app("e")).start()
    llm = ServerThread(fake_llm_app("l")).start()
    media = ServerThread(media_server_app()).start()
    media_app = media.server.config.app
    media_app.state.files.update({"a.png": png(), "b.png": png((16, 16)), "big.png": png() + b"\0" * 3000})
    settings = GatewaySettings(
        model_name=MODEL, encoder_urls=[enc.url], llm_urls=[llm.url], allowed_hosts=["127.0.0.1"],
        api_keys=[KEY, "sk-other"], max_media_bytes=2048, max_redirects=2, health_interval=0, dns_interval=0,
    )
    gw = ServerThread(create_app(settings)).start()
    client = httpx.Client(base_url=gw.url, timeout=30, headers={"authorization": f"Bearer {KEY}"})
    yield client, media.url, llm.server.config.app
    client.close()
    for s in (gw, media, llm, enc):
        s.stop()


def post(client, body):
    return client.post("/v1/chat/completions", json=body)


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_http_urls_fetched_concurrently_in_order(stack):
    client, media, _ = stack
    r = post(client, chat(image(f"{media}/files/a.png"), {"type": "text", "text": "and"}, image(f"{media}/files/b.png")))
    assert r.status_code == 200, r.text
    parts = json.loads(r.json()["choices"][0]["message"]["content"])["messages"][0]["parts"]
    assert [p.get("fill") for p in parts] == [len(png()), None, len(png((16, 16)))]


def test_redirect_followed(stack):
    client, media, _ = stack
    r = post(client, chat(image(f"{media}/redirect?to=/files/a.png")))
    assert r.status_code == 200, r.text


def test_too_many_redirects(stack):
    client, media, _ = stack
    hop3 = f"/redirect?to=/redirect%3Fto%3D/redirect%253Fto%253D/files/a.png"
    msg = error(post(client, chat(image(media + hop3))), 400)["message"]
    assert "too many redirects" in msg


def test_ssrf_refuses_unlisted_private_address(stack):
    client, media, _ = stack
    port = media.rsplit(":", 1)[1]
    err = error(post(client, chat(image(f"http://127.0.0.2:{port}/files/a.png"))), 400)
    assert "non-public address 127.0.0.2" in err["message"] and err["param"] == "messages[0].content[0]"
    err = error(post(client, chat(image("http://169.254.169.254/latest/meta-data/"))), 400)
    assert "non-public" in err["message"]


def test_ssrf_checked_again_on_redirect(stack):
    client, media, _ = stack
    port = media.rsplit(":", 1)[1]
    r = post(client, chat(image(f"{media}/redirect?to=http://127.0.0.2:{port}/files/a.png")))
    assert "non-public address 127.0.0.2" in error(r, 400)["message"]


def test_fetch_errors_are_400(stack):
    client, media, _ = stack
    assert "HTTP 404" in error(post(client, chat(image(f"{media}/files/nope.png"))), 400)["message"]
    assert "exceeds 2048 bytes" in error(post(client, chat(image(f"{media}/files/big.png"))), 400)["message"]
    assert "scheme 'file'" in error(post(client, chat(image("file:///etc/passwd"))), 400)["message"]
    assert "could not fetch" in error(post(client, chat(image("http://127.0.0.1:1/x.png"))), 400)["message"]


def test_api_key_required_on_v1_only(stack):
    client, _, _ = stack
    url = str(client.base_url)
    anon = httpx.Client(base_url=url, timeout=10)
    try:
        err = error(anon.post("/v1/chat/completions", json=chat({"type": "text", "text": "x"})), 401)
        assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
        assert error(anon.get("/v1/models"), 401)["message"].startswith("missing API key")
        bad = anon.get("/v1/models", headers={"authorization": "Bearer sk-wrong"})
        assert error(bad, 401)["message"] == "incorrect API key provided"
        assert anon.get("/v1/models", headers={"authorization": "Bearer sk-other"}).status_code == 200
        assert anon.get("/healthz").status_code == 200 and anon.get("/metrics").status_code == 200
        assert anon.get("/readyz").status_code == 200
    finally:
        anon.close()
    assert client.get("/v1/models").status_code == 200


def test_client_disconnect_aborts_upstream_stream(stack):
    client, _, llm_app = stack
    llm_app.state.aborted.clear()
    with client.stream("POST", "/v1/chat/completions", json=chat({"type": "text", "text": "SLOW"}, stream=True)) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.monotonic() + 5
    while not llm_app.state.aborted.is_set() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert llm_app.state.aborted.is_set(), "closing the client stream must close the upstream generation"


def test_client_disconnect_aborts_non_stream_request(stack):
    client, _, llm_app = stack
    llm_app.state.aborted.clear()
    with pytest.raises(httpx.ReadTimeout):
        client.post("/v1/chat/completions", json=chat({"type": "text", "text": "SLOW"}), timeout=0.5)
    deadline = time.monotonic() + 5
    while not llm_app.state.aborted.is_set() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert llm_app.state.aborted.is_set(), "a client hanging up must cancel the upstream call"


def test_body_limit(stack):
    client, _, _ = stack
    # max_request_media_bytes default 128 MiB -> limit ~179 MiB; only the header is sent
    host, port = str(client.base_url).removeprefix("http://").rstrip("/").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"authorization: Bearer " + KEY.encode() + b"\r\ncontent-length: 10000000000\r\n\r\n{")
        head = b""
        while b"}}" not in head and (chunk := s.recv(65536)):
            head += chunk
        head = head.decode()
    assert head.startswith("HTTP/1.1 413") and "request_too_large" in head
