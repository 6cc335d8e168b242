"""``python -m gateway``: serve with settings from ``MMSERVE_GATEWAY_*`` environment variables."""

from gateway.app import run
from shared.settings import GatewaySettings

if __name__ == "__main__":
    run(GatewaySettings())
