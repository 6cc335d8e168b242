"""Honest defaults: a service that listens beyond loopback without its secret (the gateway's
API keys, the encoders' and LLMs' service token) says so, at start in the log and on every
``/readyz`` (a ``warnings`` list), so an open deployment is never open silently."""

from __future__ import annotations

import ipaddress
import logging


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` is reachable from this machine only (``127.0.0.0/8``, ``::1``,
    ``localhost``); a wildcard (``0.0.0.0``, ``::``) or any other name or address is not."""
    name = host.strip().strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything, so it counts as reachable


def open_bind_warnings(host: str, secret_set: bool, env_name: str, service: str, exposed: str) -> list[str]:
    """The warning for a service listening on ``host`` without its secret (``env_name``), or
    none. ``exposed``: what a caller who can reach it may then do."""
    if secret_set or is_loopback(host):
        return []
    return [f"{env_name} is not set and the {service} listens on {host}: {exposed}, for anyone who can reach it; "
            f"set {env_name} (or bind to 127.0.0.1)"]


def service_token_warnings(host: str, token: str | None, env_prefix: str, service: str, exposed: str) -> list[str]:
    """``open_bind_warnings`` for an encoder or LLM (``env_prefix``: ``MMSERVE_ENCODER_``...)."""
    return open_bind_warnings(host, bool(token), f"{env_prefix}SERVICE_TOKEN", service, exposed)


def log_warnings(logger: logging.Logger, warnings: list[str]) -> None:
    """Each warning once, at WARNING level (start-up)."""
    for w in warnings:
        logger.warning("%s", w)
