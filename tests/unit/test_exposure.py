"""Open-by-default warnings (shared.exposure, gateway.exposure): which binds count as loopback,
and that each warning names the setting that closes it."""

from __future__ import annotations

import pytest

from gateway.exposure import exposure_warnings
from shared.exposure import is_loopback, service_token_warnings
from shared.settings import GatewaySettings

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost", "LOCALHOST", "a.localhost"])
def test_loopback_binds(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "192.168.1.2", "fe80::1", "gateway.internal", ""])
def test_binds_beyond_loopback(host):
    assert not is_loopback(host)


def test_gateway_without_keys_beyond_loopback_warns_naming_the_setting():
    (w,) = exposure_warnings(GatewaySettings(host="0.0.0.0"))
    assert "MMSERVE_GATEWAY_API_KEYS" in w and "0.0.0.0" in w
    assert exposure_warnings(GatewaySettings(host="0.0.0.0", api_keys=["k"])) == []
    assert exposure_warnings(GatewaySettings(host="127.0.0.1")) == []


def test_services_without_a_token_beyond_loopback_warn_naming_the_setting():
    (w,) = service_token_warnings("::", None, "MMSERVE_LLM_", "LLM service", "anything goes")
    assert "MMSERVE_LLM_SERVICE_TOKEN" in w and "anything goes" in w
    assert service_token_warnings("::", "t0ken", "MMSERVE_LLM_", "LLM service", "x") == []
    assert service_token_warnings("127.0.0.1", None, "MMSERVE_ENCODER_", "encoder", "x") == []
