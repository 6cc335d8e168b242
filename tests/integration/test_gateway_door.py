"""The door before the work (issue 42, item 2), over real HTTP against the fake encoder / LLM:
the API key is checked before the body is read, the body is capped per endpoint while it
streams in, and a generation's admission slot is taken before its body is read."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from gateway.app import create_app
from mmserve.testing.fake_services import ServerThread
from shared.settings import GatewaySettings

pytestmark = pytest.mark.integration

MODEL = "tiny-test"
KEY = "k-door"
AUTH = {"authorization": f"Bearer {KEY}"}
MiB = 1024 * 1024


class BodyReadSpy:
    """Wraps the gateway app: counts the request body bytes the app pulls through ``receive``."""

    def __init__(self, app) -> None:
        self.app = app
        self.read = 0

    async def __call__(self, scope, receive, send) -> None:
        async def counted():
            message = await receive()
            if message["type"] == "http.request":
                self.read += len(message.get("body", b""))
            return message

        await self.app(scope, counted if scope["type"] == "http" else receive, send)


class Upload:
    """A body of ``chunks`` MiB, produced as the client sends it (never held whole)."""

    def __init__(self, chunks: int, fill: bytes = b"A") -> None:
        self.chunks, self.fill, self.sent = chunks, fill, 0

    def __iter__(self):
        for _ in range(self.chunks):
            self.sent += 1
            yield self.fill * MiB


def headers_only(url: str, path: str, length: int, headers: dict) -> tuple[int, dict]:
    """POST ``path`` declaring a ``length``-byte body but sending none of it; the answer the
    server gives from the headers alone. (Sent whole, a refused body races the server's close:
    the client may see a reset before it reads the 413, as with any server that does not drain.)"""
    where = urlsplit(url)
    head = "".join(f"{k}: {v}\r\n" for k, v in {**headers, "host": where.netloc, "content-length": length}.items())
    with socket.create_connection((where.hostname, where.port), timeout=30) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\n{head}\r\n".encode())
        data = b""
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _content_length(data):
            chunk = sock.recv(65536)
            assert chunk, f"the server closed before answering: {data!r}"
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.partition(b"\r\n\r\n")[2][:_content_length(data)])


def _content_length(response: bytes) -> int:
    match = re.search(rb"(?im)^content-length:\s*(\d+)", response.partition(b"\r\n\r\n")[0])
    return int(match.group(1)) if match else 1 << 30


def settings(upstreams, **kw) -> GatewaySettings:
    enc, llm = upstreams
    return GatewaySettings(model_name=MODEL, encoder_urls=[enc.url], llm_urls=[llm.url], dns_interval=0,
                           health_interval=0, connect_timeout=2, **kw)


@pytest.fixture(scope="module")
def door(upstreams):
    """A gateway with a key, small per-endpoint body limits, behind the read spy."""
    spy = BodyReadSpy(create_app(settings(upstreams, api_keys=[KEY], max_text_body_bytes=64 * 1024,
                                          max_request_media_bytes=MiB)))
    server = ServerThread(spy).start()
    yield server, spy
    server.stop()


def chat_body(text: str = "hello") -> dict:
    return {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": text}]}


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize"])
def test_a_200_mb_body_without_a_key_is_a_401_before_any_of_it_is_read(door, path, declared):
    server, spy = door
    body = Upload(200)
    headers = {"content-type": "application/json", **({"content-length": str(200 * MiB)} if declared else {})}
    before = spy.read
    r = httpx.post(server.url + path, content=iter(body), headers=headers, timeout=30)
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    assert spy.read == before  # the app never pulled a byte of the body
    assert body.sent < 100  # the connection was dropped, not drained: the client stopped early
    # the gateway is not held by any of it
    assert httpx.get(server.url + "/healthz", timeout=5).status_code == 200


def test_a_wrong_key_is_refused_at_the_door_too(door):
    server, spy = door
    before = spy.read
    status, body = headers_only(server.url, "/v1/chat/completions", 256 * 1024,
                                {"authorization": "Bearer nope", "content-type": "application/json"})
    assert status == 401 and body["error"]["message"] == "incorrect API key provided"
    assert spy.read == before


def test_protected_paths_need_the_key_and_probes_stay_open(door):
    server, _ = door
    with httpx.Client(base_url=server.url, timeout=30) as c:
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                             ("POST", "/v1/responses"), ("POST", "/tokenize"), ("POST", "/detokenize"),
                             ("GET", "/dashboard/data"), ("GET", "/v1/no-such-path")]:
            assert c.request(method, path).status_code == 401, path
            assert c.request(method, path, headers={"authorization": "Bearer nope"}).status_code == 401, path
        # a key in the query string is not a key (it would land in access logs)
        assert c.get("/dashboard/data", params={"key": KEY}).status_code == 401
        assert c.get("/v1/models", headers=AUTH).status_code == 200
        assert c.get("/dashboard/data", headers=AUTH).status_code == 200
        for path in ("/healthz", "/readyz", "/metrics", "/dashboard", "/dashboard/static/dashboard.js"):
            assert c.get(path).status_code == 200, path


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize", "/detokenize"])
def test_a_text_endpoint_body_over_its_limit_is_a_413_naming_the_setting(door, path, declared):
    server, spy = door
    body = Upload(200)
    headers = {**AUTH, "content-type": "application/json", **({"content-length": str(200 * MiB)} if declared else {})}
    before = spy.read
    r = httpx.post(server.url + path, content=iter(body), headers=headers, timeout=30)
    assert r.status_code == 413, r.text  # an OpenAI error, not a 500 from inside the body read
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
    assert "max_text_body_bytes (MMSERVE_GATEWAY_MAX_TEXT_BODY_BYTES)" in err["message"]
    # declared: refused from the header alone; chunked: read up to the limit, then cut off
    assert spy.read - before <= (0 if declared else 64 * 1024 + MiB)
    assert body.sent < 100
    assert httpx.get(server.url + "/healthz", timeout=5).status_code == 200


def test_chat_takes_the_media_budget_where_completions_take_the_text_limit(door, upstreams):
    server, _ = door
    _, llm = upstreams
    text = "word " * (40 * 1024)  # 200 KiB: over the text limit (64 KiB), well within chat's
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        assert c.post("/v1/chat/completions", json=chat_body(text)).status_code == 200
        n = len(llm.server.config.app.state.requests)
        status, body = headers_only(server.url, "/v1/completions", len(text) + 64,
                                    {**AUTH, "content-type": "application/json"})
        assert status == 413 and "max_text_body_bytes" in body["error"]["message"]
        # chat's own limit: the media budget base64-encoded plus 8 MiB of text
        status, body = headers_only(server.url, "/v1/chat/completions", 11 * MiB,
                                    {**AUTH, "content-type": "application/json"})
        assert status == 413 and "max_request_media_bytes" in body["error"]["message"]
        assert len(llm.server.config.app.state.requests) == n


def _hold_the_only_slot(c: httpx.Client):
    return c.stream("POST", "/v1/chat/completions", json={**chat_body("SLOW"), "stream": True})


def _wait_free(server) -> None:
    gate = server.server.config.app.state.gateway.admission
    deadline = time.monotonic() + 10
    while gate.in_flight:
        assert time.monotonic() < deadline, "a slot was never given back"
        time.sleep(0.02)
    gate.check_integrity()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/responses", "/v1/chat/completions"])
def test_a_full_gate_refuses_every_generation_path_before_its_body_is_parsed(upstreams, path):
    server = ServerThread(create_app(settings(upstreams, max_in_flight=1, max_queue=0))).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            with _hold_the_only_slot(c) as first:
                assert first.status_code == 200
                r = c.post(path, content=b"{not json", headers={"content-type": "application/json"})
                assert r.status_code == 429, r.text  # not the 400 its parse would give
                assert r.json()["error"]["code"] == "overloaded" and int(r.headers["retry-after"]) >= 1
            _wait_free(server)
            assert c.post(path, content=b"{not json", headers={"content-type": "application/json"}).status_code == 400
            _wait_free(server)
    finally:
        server.stop()


def test_a_slot_is_held_while_the_body_streams_in(upstreams):
    """The ticket is taken before the body is read: a completions body still arriving holds
    the only slot (a chat meanwhile is a 429), and the slot comes back once it is answered."""
    server = ServerThread(create_app(settings(upstreams, max_in_flight=1, max_queue=0))).start()
    go_on = threading.Event()
    result: dict = {}

    def slow_body():
        yield b'{"model": "' + MODEL.encode() + b'", "max_tokens": 2, '
        go_on.wait(30)
        yield b'"prompt": "hello"}'

    def upload():
        result["r"] = httpx.post(server.url + "/v1/completions", content=slow_body(),
                                 headers={"content-type": "application/json"}, timeout=60)

    sender = threading.Thread(target=upload)
    try:
        sender.start()
        gate = server.server.config.app.state.gateway.admission
        deadline = time.monotonic() + 10
        while not gate.in_flight:
            assert time.monotonic() < deadline, "the arriving body took no slot"
            time.sleep(0.02)
        r = httpx.post(server.url + "/v1/chat/completions", json=chat_body(), timeout=30)
        assert r.status_code == 429, r.text
        go_on.set()
        sender.join(30)
        assert result["r"].status_code == 200, result["r"].text
        _wait_free(server)
        assert httpx.post(server.url + "/v1/chat/completions", json=chat_body(), timeout=30).status_code == 200
    finally:
        go_on.set()
        sender.join(30)
        server.stop()
