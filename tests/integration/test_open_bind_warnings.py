"""Honest defaults (issue 42, item 5): a service listening beyond loopback without its secret
(the gateway's API keys, the encoder's and LLM's service token) warns at start naming the
setting, and says so on its /readyz (``warnings``) and, for the gateway, on the dashboard's data."""

from __future__ import annotations

import logging

import httpx
import pytest

from encoder_svc.app import create_app as encoder_app
from gateway.app import create_app as gateway_app
from llm_svc.front.app import create_app as llm_app
from mmserve.testing.fake_services import ServerThread
from shared.settings import EncoderSettings, GatewaySettings, LLMSettings

pytestmark = pytest.mark.integration


def gateway(upstreams, **kw) -> ServerThread:
    enc, llm = upstreams
    return ServerThread(gateway_app(GatewaySettings(model_name="m", encoder_urls=[enc.url], llm_urls=[llm.url],
                                                    dns_interval=0, health_interval=0, **kw)))


def test_an_open_gateway_says_so_at_start_on_readyz_and_on_the_dashboard(upstreams, caplog):
    # settings.host is what the gateway is told it binds (the test server itself listens on loopback)
    with caplog.at_level(logging.WARNING, logger="mmserve.gateway"), gateway(upstreams, host="0.0.0.0") as gw:
        logged = [r.getMessage() for r in caplog.records if "MMSERVE_GATEWAY_API_KEYS" in r.getMessage()]
        assert len(logged) == 1 and "0.0.0.0" in logged[0]
        ready = httpx.get(gw.url + "/readyz", timeout=10).json()
        assert ready["warnings"] == logged
        data = httpx.get(gw.url + "/dashboard/data", timeout=30).json()
        assert data["warnings"][0] == logged[0]


@pytest.mark.parametrize("kw", [{"host": "0.0.0.0", "api_keys": ["k"]}, {"host": "127.0.0.1"}],
                         ids=["keys-set", "loopback"])
def test_a_closed_gateway_has_no_warning(upstreams, kw, caplog):
    with caplog.at_level(logging.WARNING, logger="mmserve.gateway"), gateway(upstreams, **kw) as gw:
        assert httpx.get(gw.url + "/readyz", timeout=10).json()["warnings"] == []
        assert not [r for r in caplog.records if "API_KEYS" in r.getMessage()]
        headers = {"authorization": "Bearer k"} if "api_keys" in kw else {}
        assert httpx.get(gw.url + "/dashboard/data", headers=headers, timeout=30).json()["warnings"] == []


@pytest.mark.parametrize("token", [None, "t0ken"], ids=["no-token", "token"])
@pytest.mark.parametrize("service", ["encoder", "llm"])
def test_services_beyond_loopback_without_a_token_warn(service, token, mimo_bundle, tmp_path, caplog):
    if service == "encoder":
        app, env = encoder_app(EncoderSettings(model_dir=str(mimo_bundle), host="0.0.0.0", service_token=token)), \
            "MMSERVE_ENCODER_SERVICE_TOKEN"
    else:  # no model at all: /readyz is a 503, and still carries the warning
        app, env = llm_app(LLMSettings(model_dir=str(tmp_path / "missing"), host="0.0.0.0", service_token=token)), \
            "MMSERVE_LLM_SERVICE_TOKEN"
    with caplog.at_level(logging.WARNING), ServerThread(app) as svc:
        warnings = httpx.get(svc.url + "/readyz", timeout=10).json()["warnings"]
        logged = [r.getMessage() for r in caplog.records if env in r.getMessage()]
    if token is None:
        assert len(warnings) == 1 and env in warnings[0] and "0.0.0.0" in warnings[0]
        assert logged == warnings
    else:
        assert warnings == [] and logged == []
