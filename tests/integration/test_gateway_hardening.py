"""Bad input and upstream trouble the gateway must answer cleanly (issue 11), over real HTTP
against the fake encoder / LLM services."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from gateway.app import create_app
from gateway.state import GatewayState
from mmserve.testing.fake_services import ServerThread, fake_encoder_app, fake_llm_app
from shared.settings import GatewaySettings
from tests.integration.test_gateway_chat import chat, image_part, png

pytestmark = pytest.mark.integration

MODEL = "tiny-test"


def settings(enc, llm, **kw) -> GatewaySettings:
    return GatewaySettings(model_name=MODEL, encoder_urls=[enc.url], llm_urls=[llm.url], dns_interval=0,
                           connect_timeout=2, **{"health_interval": 0, **kw})


@pytest.fixture(scope="module")
def gw(upstreams):
    server = ServerThread(create_app(settings(*upstreams))).start()
    yield server
    server.stop()


def raw_post(url: str, body: str, **kw) -> httpx.Response:
    """POST a JSON text as is (the client libraries would refuse a lone surrogate)."""
    return httpx.post(url + "/v1/chat/completions", content=body.encode(),
                      headers={"content-type": "application/json"}, timeout=30, **kw)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("where", ["content", "model", "stop"])
def test_lone_surrogate_is_a_400_naming_the_field(gw, upstreams, stream, where):
    _, llm = upstreams
    n = len(llm.server.config.app.state.requests)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    if where == "content":
        body["messages"][0]["content"] = [{"type": "text", "text": "SURROGATE hi"}]
    elif where == "model":
        body["model"] = "SURROGATE"
    else:
        body["stop"] = ["SURROGATE"]
    text = json.dumps(body).replace("SURROGATE", "\\ud800")  # JSON-escaped, as a client sends it
    r = raw_post(gw.url, text)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "surrogate" in err["message"] and err["code"] == "invalid_text"
    expected = {"content": "messages[0].content[0].text", "model": "model", "stop": "stop[0]"}[where]
    assert err["param"] == expected
    assert len(llm.server.config.app.state.requests) == n  # nothing was sent on
    # a well-formed pair (an emoji written as two escapes) is fine
    ok = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "SURR"}]}).replace("SURR", "\\ud83d\\ude00")
    assert raw_post(gw.url, ok).status_code == 200


def test_prompt_that_cannot_fit_is_refused_before_any_upstream_call(upstreams):
    enc, llm = upstreams
    llm_app, enc_app = llm.server.config.app, enc.server.config.app
    llm_app.state.limits = {"max_model_len": 100, "max_token_bytes": 4}
    try:
        server = ServerThread(create_app(settings(enc, llm, health_interval=0.1))).start()
        try:
            state = server.server.config.app.state.gateway
            deadline = time.monotonic() + 10
            while state.llm_limits.best() is None:
                assert time.monotonic() < deadline, "the gateway never learned the LLM's limits"
                time.sleep(0.05)
            n_llm, n_enc = len(llm_app.state.requests), len(enc_app.state.calls)
            big = {"type": "text", "text": "x" * 8_000_000}
            t0 = time.monotonic()
            r = httpx.post(server.url + "/v1/chat/completions", json=chat(big, image_part(png())), timeout=60)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "context_length_exceeded" and "100 tokens" in err["message"]
            assert (len(llm_app.state.requests), len(enc_app.state.calls)) == (n_llm, n_enc)
            assert time.monotonic() - t0 < 30
            # what fits the bound goes through (and max_tokens counts against it)
            fits = chat({"type": "text", "text": "x" * 300}, max_tokens=10)
            assert httpx.post(server.url + "/v1/chat/completions", json=fits, timeout=30).status_code == 200
            too_many = chat({"type": "text", "text": "x" * 300}, max_tokens=50)
            r = httpx.post(server.url + "/v1/chat/completions", json=too_many, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        finally:
            server.stop()
    finally:
        llm_app.state.limits = None


def test_abort_finish_reason_never_reaches_the_client(gw):
    r = httpx.post(gw.url + "/v1/chat/completions", json=chat({"type": "text", "text": "ABORT"}), timeout=30)
    assert r.status_code == 503 and "retry" in r.json()["error"]["message"]
    r = httpx.post(gw.url + "/v1/chat/completions", json=chat({"type": "text", "text": "ABORT"}, stream=True),
                   timeout=30)
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "error" in json.loads(events[-2])
    assert all(json.loads(e).get("choices", [{}])[0].get("finish_reason") != "abort"
               for e in events[:-1] if "choices" in e)


@pytest.mark.parametrize("status,want", [(429, 429), (500, 502), (503, 502)])
def test_llm_errors_map_to_clean_statuses(gw, upstreams, status, want):
    _, llm = upstreams
    app = llm.server.config.app
    app.state.fail_5xx, app.state.fail_status = True, status
    try:
        n = len(app.state.requests)
        r = httpx.post(gw.url + "/v1/chat/completions", json=chat({"type": "text", "text": "x"}), timeout=30)
        assert r.status_code == want, r.text
        if status == 429:
            assert r.headers["retry-after"] == "3" and r.json()["error"]["type"] == "rate_limit_error"
        # one replica: tried once whatever the status (503 would go to another replica)
        assert len(app.state.requests) == n + 1
    finally:
        app.state.fail_5xx, app.state.fail_status = False, 503


def test_unknown_audio_format_is_a_400(gw):
    part = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "banana"}}
    r = httpx.post(gw.url + "/v1/chat/completions", json=chat(part), timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "messages[0].content[0].input_audio.format" and "wav" in err["message"]


def test_stream_cleans_up_when_the_client_is_gone_before_the_first_byte(upstreams):
    """The response start fails (client gone): the body generator never runs, yet the LLM
    stream is closed (the fake LLM sees the abort) and the router's in-flight count returns to 0."""
    enc, llm = upstreams
    llm_app = llm.server.config.app
    app = create_app(settings(enc, llm))

    async def go() -> None:
        state = GatewayState.build(settings(enc, llm), app.state.metrics)
        app.state.gateway = state
        body = json.dumps(chat({"type": "text", "text": "SLOW"}, stream=True)).encode()
        sent = False

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.sleep(3600)

        async def send(message):
            if message["type"] == "http.response.start":
                raise OSError("client went away")

        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
            "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json"),
                                                               (b"content-length", str(len(body)).encode())],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
        }
        llm_app.state.aborted.clear()
        try:
            await app(scope, receive, send)
        except Exception:  # noqa: BLE001 - starlette re-raises the disconnect
            pass
        router = state.llms.router
        assert router.load(llm.url) == 0
        await state.close()

    asyncio.run(go())
    deadline = time.monotonic() + 10
    while not llm_app.state.aborted.is_set():
        assert time.monotonic() < deadline, "the LLM stream was never closed"
        time.sleep(0.05)


def test_past_its_admission_bound_the_gateway_answers_429_with_retry_after(upstreams):
    enc, llm = upstreams
    server = ServerThread(create_app(settings(enc, llm, max_in_flight=1, max_queue=0))).start()
    try:
        slow = chat({"type": "text", "text": "SLOW"}, stream=True)
        with httpx.Client(base_url=server.url, timeout=60) as c:
            with c.stream("POST", "/v1/chat/completions", json=slow) as first:
                assert first.status_code == 200
                t0 = time.monotonic()
                r = c.post("/v1/chat/completions", json=chat({"type": "text", "text": "x"}))
                assert r.status_code == 429 and time.monotonic() - t0 < 5  # refused, not stalled
                assert int(r.headers["retry-after"]) >= 1
                err = r.json()["error"]
                assert err["type"] == "rate_limit_error" and err["code"] == "overloaded"
            # the stream was closed: its slot is freed once the gateway sees the disconnect
            gate = server.server.config.app.state.gateway.admission
            deadline = time.monotonic() + 10
            while gate.in_flight:
                assert time.monotonic() < deadline, "the closed stream kept its admission slot"
                time.sleep(0.02)
            assert c.post("/v1/chat/completions", json=chat({"type": "text", "text": "x"})).status_code == 200
            metrics = c.get("/metrics").text
            assert 'mmserve_gateway_overload_rejections_total{by="gateway"} 1.0' in metrics
            assert "mmserve_gateway_admitted_in_flight 0.0" in metrics
        server.server.config.app.state.gateway.admission.check_integrity()
    finally:
        server.stop()


def test_a_full_gate_answers_429_before_reading_the_body(upstreams):
    """Under overload the 429 comes before the body is parsed: a body that is not even JSON
    gets the 429 (its parse would have been a 400), and a request with a wrong key still 401s."""
    enc, llm = upstreams
    server = ServerThread(create_app(settings(enc, llm, max_in_flight=1, max_queue=0, api_keys=["k1"]))).start()
    auth = {"authorization": "Bearer k1"}
    try:
        slow = chat({"type": "text", "text": "SLOW"}, stream=True)
        with httpx.Client(base_url=server.url, timeout=60) as c:
            with c.stream("POST", "/v1/chat/completions", json=slow, headers=auth) as first:
                assert first.status_code == 200
                r = c.post("/v1/chat/completions", content=b"{not json", headers=auth)
                assert r.status_code == 429, r.text
                assert r.json()["error"]["code"] == "overloaded" and int(r.headers["retry-after"]) >= 1
                bad_key = c.post("/v1/chat/completions", content=b"{not json", headers={"authorization": "Bearer no"})
                assert bad_key.status_code == 401
            gate = server.server.config.app.state.gateway.admission
            deadline = time.monotonic() + 10
            while gate.in_flight:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            # with room again the same body is parsed and refused for what it is
            assert c.post("/v1/chat/completions", content=b"{not json", headers=auth).status_code == 400
            metrics = c.get("/metrics").text
            assert 'mmserve_gateway_overload_rejections_total{by="gateway"} 1.0' in metrics
            assert 'mmserve_gateway_requests_total{route="/v1/chat/completions",status="429"} 1.0' in metrics
        gate.check_integrity()
    finally:
        server.stop()


def test_the_deadline_travels_to_the_llm(gw, upstreams):
    _, llm = upstreams
    r = httpx.post(gw.url + "/v1/chat/completions", json=chat({"type": "text", "text": "x"}), timeout=30)
    assert r.status_code == 200
    left_ms = int(llm.server.config.app.state.headers[-1]["x-mmserve-deadline-ms"])
    assert 0 < left_ms <= 300_000  # the gateway's request_timeout, less what it spent


def test_length_buckets_route_long_prompts_to_the_long_replica():
    enc = ServerThread(fake_encoder_app("e0")).start()
    short, long_ = ServerThread(fake_llm_app("short")).start(), ServerThread(fake_llm_app("long")).start()
    short.server.config.app.state.limits = {"max_model_len": 100_000, "max_token_bytes": 16,
                                            "min_prompt_tokens": 0, "max_prompt_tokens": 200}
    long_.server.config.app.state.limits = {"max_model_len": 100_000, "max_token_bytes": 16,
                                            "min_prompt_tokens": 200, "max_prompt_tokens": 100_000}
    s = GatewaySettings(model_name=MODEL, encoder_urls=[enc.url], llm_urls=[short.url, long_.url], dns_interval=0,
                        health_interval=0.1, connect_timeout=2)
    gw = ServerThread(create_app(s)).start()
    try:
        state = gw.server.config.app.state.gateway
        deadline = time.monotonic() + 10
        while len(state.llm_limits._by_url) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for text, want in (("hi there", "short"), ("word " * 400, "long"), ("ok", "short")):
            r = httpx.post(gw.url + "/v1/chat/completions", json=chat({"type": "text", "text": text}), timeout=30)
            assert r.status_code == 200
            assert json.loads(r.json()["choices"][0]["message"]["content"])["replica"] == want
    finally:
        for server in (gw, enc, short, long_):
            server.stop()


def test_priority_reaches_the_llm(gw):
    r = httpx.post(gw.url + "/v1/chat/completions", json=chat({"type": "text", "text": "x"}, priority=-3), timeout=30)
    assert r.status_code == 200
    assert json.loads(r.json()["choices"][0]["message"]["content"])["sampling"]["priority"] == -3
