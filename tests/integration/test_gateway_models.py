"""``/v1/models`` names what the LLM replicas serve when the gateway is started without a name,
and the name given when it is."""

from __future__ import annotations

import time

import httpx
import pytest

from gateway.app import create_app
from mmserve.testing.fake_services import ServerThread, fake_encoder_app, fake_llm_app
from shared.settings import GatewaySettings

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("given", [None, "my-name"])
def test_models_lists_the_replicas_model_unless_named(given):
    enc = ServerThread(fake_encoder_app("e0")).start()
    llm = ServerThread(fake_llm_app("l0")).start()
    s = GatewaySettings(model_name=given, encoder_urls=[enc.url], llm_urls=[llm.url], dns_interval=0,
                        health_interval=0.2, connect_timeout=2, request_timeout=20)
    gw = ServerThread(create_app(s)).start()
    try:
        want = given or "l0"
        for _ in range(50):
            ids = [m["id"] for m in httpx.get(f"{gw.url}/v1/models", timeout=10).json()["data"]]
            if ids == [want]:
                break
            time.sleep(0.1)
        assert ids == [want]
        body = {"model": want, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=20).status_code == 200
        other = {**body, "model": "mmserve-tiny" if want != "mmserve-tiny" else "x"}
        assert httpx.post(f"{gw.url}/v1/chat/completions", json=other, timeout=20).status_code == 404
    finally:
        for server in (gw, enc, llm):
            server.stop()
