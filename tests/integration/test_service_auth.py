"""Who may reach what: with API keys set the gateway's dashboard needs one; with a service token
set, the real encoder and LLM apps refuse callers without it (probes and scrapes stay open), and
a gateway holding the token reaches an LLM that requires it (real HTTP on loopback)."""

from __future__ import annotations

import httpx
import pytest

from encoder_svc.app import create_app as encoder_app
from gateway.app import create_app as gateway_app
from mmserve.testing.fake_services import ServerThread, fake_encoder_app, fake_llm_app
from llm_svc.front.app import create_app as llm_app
from shared.service_auth import SERVICE_TOKEN_HEADER, ServiceTokenMiddleware
from shared.settings import EncoderSettings, GatewaySettings, LLMSettings

pytestmark = pytest.mark.integration

TOKEN = "s3rvice-t0ken"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


def gateway(llm_url: str, enc_url: str, **kw) -> ServerThread:
    return ServerThread(gateway_app(GatewaySettings(model_name="m", encoder_urls=[enc_url], llm_urls=[llm_url],
                                                    dns_interval=0, health_interval=0, **kw))).start()


def test_dashboard_needs_a_key_when_keys_are_set():
    llm, enc = ServerThread(fake_llm_app("l")).start(), ServerThread(fake_encoder_app("e")).start()
    try:
        with gateway(llm.url, enc.url, api_keys=["k1"]) as gw:
            path = "/dashboard/data"
            assert httpx.get(gw.url + path, timeout=10).status_code == 401
            assert httpx.get(gw.url + path, headers={"authorization": "Bearer nope"}, timeout=10).status_code == 401
            assert httpx.get(gw.url + path, headers={"authorization": "Bearer k1"}, timeout=30).status_code == 200
            # never in the query string (access logs keep URLs): the page takes it from the fragment
            assert httpx.get(gw.url + path, params={"key": "k1"}, timeout=30).status_code == 401
            # the page and its script hold no data: open, so a browser can load them and ask for the key
            assert httpx.get(gw.url + "/dashboard", timeout=10).status_code == 200
            assert httpx.get(gw.url + "/dashboard/static/dashboard.js", timeout=10).status_code == 200
        with gateway(llm.url, enc.url) as gw:  # no keys: open, as before
            assert httpx.get(gw.url + "/dashboard/data", timeout=30).status_code == 200
    finally:
        llm.stop()
        enc.stop()


@pytest.mark.parametrize("make", [
    lambda bundle, tmp: encoder_app(EncoderSettings(model_dir=str(bundle), service_token=TOKEN)),
    lambda bundle, tmp: llm_app(LLMSettings(model_dir=str(tmp / "missing"), service_token=TOKEN)),
], ids=["encoder", "llm"])
def test_services_refuse_callers_without_the_token(make, mimo_bundle, tmp_path):
    # the token is checked before anything else (the LLM here has no model at all and still
    # refuses a caller without it); probes are answered
    with ServerThread(make(mimo_bundle, tmp_path)) as svc:
        for path in ("/v1/generate", "/v1/encode", "/kv/snapshot", "/v1/embeddings/k"):
            r = httpx.post(svc.url + path, content=b"{}", timeout=10)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_service_token", (path, r.text)
            r = httpx.post(svc.url + path, content=b"{}", headers={SERVICE_TOKEN_HEADER: "wrong"}, timeout=10)
            assert r.status_code == 401
            r = httpx.post(svc.url + path, content=b"{}", headers={SERVICE_TOKEN_HEADER: TOKEN}, timeout=10)
            assert r.status_code != 401, (path, r.text)
        for path in ("/healthz", "/readyz", "/metrics"):
            assert httpx.get(svc.url + path, timeout=10).status_code != 401


def test_gateway_sends_the_token_to_llms_that_require_it():
    guarded = fake_llm_app("l")
    guarded.add_middleware(ServiceTokenMiddleware, token=TOKEN)
    llm, enc = ServerThread(guarded).start(), ServerThread(fake_encoder_app("e")).start()
    try:
        with gateway(llm.url, enc.url, service_token=TOKEN) as gw:
            r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
            assert r.status_code == 200, r.text
        with gateway(llm.url, enc.url) as gw:  # a gateway without the token is refused upstream
            r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
            assert r.status_code >= 400
        assert len(guarded.state.requests) == 1
    finally:
        llm.stop()
        enc.stop()
