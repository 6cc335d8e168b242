"""Contract test: schemathesis drives the gateway's own OpenAPI document (real HTTP, fake
upstreams); no answer may be a 5xx, break its documented schema, status or content type."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from gateway.app import create_app
from mmserve.testing.fake_services import ServerThread, fake_encoder_app, fake_llm_app
from shared.settings import GatewaySettings

pytestmark = pytest.mark.integration

MODEL = "tiny-test"


@pytest.fixture(scope="module")
def gateway_schema():
    enc = ServerThread(fake_encoder_app("e0")).start()
    llm = ServerThread(fake_llm_app("l0")).start()
    s = GatewaySettings(model_name=MODEL, encoder_urls=[enc.url], llm_urls=[llm.url], dns_interval=0,
                        health_interval=0, connect_timeout=2, request_timeout=20)
    gw = ServerThread(create_app(s)).start()
    try:
        yield schemathesis.openapi.from_url(f"{gw.url}/openapi.json")
    finally:
        for server in (gw, enc, llm):
            server.stop()


# the dashboard (HTML, issue 12) is for browsers; its page has its own headless-browser test
schema = schemathesis.pytest.from_fixture("gateway_schema").exclude(path_regex="^/dashboard")


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_gateway_honours_its_openapi_contract(case):
    # rules JSON Schema cannot state (a lone surrogate, a prompt too long for the model, an
    # unknown model name) make some schema-valid requests a documented 400/404: not a violation
    case.call_and_validate(excluded_checks=[schemathesis.checks.positive_data_acceptance])
