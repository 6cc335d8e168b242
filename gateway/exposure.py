"""The gateway's open-by-default warning (``shared.exposure``): no ``api_keys`` while it listens
beyond loopback. Logged at start, listed on ``/readyz`` and on the dashboard."""

from __future__ import annotations

import logging

from shared.exposure import log_warnings, open_bind_warnings
from shared.settings import GatewaySettings

log = logging.getLogger("mmserve.gateway")


def exposure_warnings(settings: GatewaySettings) -> list[str]:
    """What is open that should not be, one sentence each naming the setting that closes it."""
    return open_bind_warnings(
        settings.host, bool(settings.api_keys), "MMSERVE_GATEWAY_API_KEYS", "gateway",
        "/v1/*, /tokenize, /detokenize and the dashboard's data (replica addresses, load) answer without a key",
    )


def log_exposure(settings: GatewaySettings) -> None:
    log_warnings(log, exposure_warnings(settings))
