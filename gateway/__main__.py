"""``python -m gateway``: serve with settings from ``MMSERVE_GATEWAY_*`` environment variables."""

from gateway.app import run
from shared.env_check import check_service_env
from shared.settings import GatewaySettings

if __name__ == "__main__":
    check_service_env("gateway")  # unknown MMSERVE_* variables: warnings, or exit 2 with --strict-env
    run(GatewaySettings())
