"""Settings that cannot be mistyped: every ``MMSERVE_*`` variable a service starts with names a
setting of it, a variable read by name (``OTHER_VARS``), or another service's setting.

A settings model reads the environment with ``extra="ignore"``, so ``MMSERVE_GATEWAY_FAIL_THRESHOLD``
(the setting is ``health_fail_threshold``) would otherwise be dropped without a word. Here each
unknown variable is a warning naming the nearest real one; with ``--strict-env`` or
``MMSERVE_STRICT_ENV=1`` the same messages are a start-up error, exit code 2.

In a shared environment (one ``.env`` for every Compose service) a variable of another service is
no typo: it is logged at debug level, and an unknown one under another service's prefix is left to
that service to report.
"""

from __future__ import annotations

import difflib
import logging
import os
import sys
from collections.abc import Iterable, Mapping, Sequence

from pydantic import AliasChoices
from pydantic_settings import BaseSettings

log = logging.getLogger("mmserve.env")

PREFIX = "MMSERVE_"
STRICT_FLAG = "--strict-env"
STRICT_VAR = "MMSERVE_STRICT_ENV"
EXIT_CODE = 2  # as argparse's for a bad flag
LABELS = {"gateway": "the gateway", "encoder": "the encoder", "llm": "the LLM service", "up": "any service"}

# MMSERVE_* variables read by name rather than as a setting: name -> who reads it and what for.
# Known to every service (a shell or .env that sets them for one tool is no typo).
OTHER_VARS: dict[str, str] = {
    "MMSERVE_CACHE_DIR": "every process: the root of the model and kernel caches (shared/cache_dir.py); "
    "default ~/.cache/mmserve",
    "MMSERVE_CACHE": "deprecated name of MMSERVE_CACHE_DIR (still read when that is unset, with a warning)",
    STRICT_VAR: "every service and mmserve up: 1 makes an unknown MMSERVE_* variable a start-up error "
    "(as --strict-env)",
    "MMSERVE_PEER_KEY": "mmserve up and compose.yaml: the peer_key of every service",
    "MMSERVE_SERVICE_TOKEN": "compose.yaml (.env): the service_token of every service",
    "MMSERVE_REDIS_PASSWORD": "compose.yaml (.env): Redis's requirepass, in every service's Redis URL",
    "MMSERVE_REDIS_USER": "compose.yaml (.env): the Redis ACL user of every Redis URL (default: default)",
    "MMSERVE_API_KEYS": "compose.yaml (.env) and deploy/k8s/make-secrets.sh: the gateway's api_keys",
    "MMSERVE_MODEL_DIR": "compose.yaml: the bundle directory mounted into every service",
    "MMSERVE_MODEL_NAME": "compose.yaml: the gateway's model_name (default tiny-mimo)",
    "MMSERVE_DEVICE": "compose.yaml, compose.gpu.yaml: the device of the encoders and LLMs",
    "MMSERVE_PORT": "compose.yaml: the gateway's published port (default 8000)",
    "MMSERVE_ENCODER_REPLICAS": "compose.yaml: encoder replicas (default 1)",
    "MMSERVE_LLM_REPLICAS": "compose.yaml: LLM replicas (default 1)",
    "MMSERVE_LLM_PREFILL_REPLICAS": "compose.disagg.yaml: prefill LLM replicas (default 1)",
    "MMSERVE_HANDOVER_PORT": "compose.disagg.yaml: the decode replicas' hand-over port (default 8300)",
    "MMSERVE_PROMETHEUS_PORT": "compose.yaml (monitoring profile): Prometheus's published port (default 9090)",
    "MMSERVE_GRAFANA_PORT": "compose.yaml (monitoring profile): Grafana's published port (default 3000)",
    "MMSERVE_LLM_CORE_SETTINGS": "llm_svc/core/process.py: the LLM service hands its settings (JSON) to its engine "
    "core process; set by the service, not by hand",
    "MMSERVE_TRACEMALLOC": "every service and the engine core (shared/memtrace.py): 1 writes tracemalloc growth "
    "reports (a debugging aid; slows the process)",
    "MMSERVE_TRACEMALLOC_DIR": "shared/memtrace.py: where the tracemalloc growth reports go",
    "MMSERVE_TRACEMALLOC_INTERVAL": "shared/memtrace.py: seconds between tracemalloc snapshots",
    "MMSERVE_TRACEMALLOC_FRAMES": "shared/memtrace.py: frames kept per tracemalloc trace",
    "MMSERVE_BENCH_CACHE": "benchmarks: where the encoder benchmarks keep their bundles",
    "MMSERVE_BENCH_RESULTS": "benchmarks: where the smoke runs write their results",
    "MMSERVE_BENCH_LOCK_WAIT": "benchmarks: seconds to wait for the machine-wide benchmark lock (default 3600)",
    "MMSERVE_BENCH_LOCK_HELD": "benchmarks: set while a run holds the benchmark lock (inherited by its services)",
    "MMSERVE_ORACLE_AS_SERVED": "scripts/vllm_mimo_audio_oracle.py: 1 keeps vLLM's served dtypes",
    "MMSERVE_IMAGE": "compose.yaml: the mmserve image of the encoders, LLMs and gateway (default mmserve:latest)",
    "MMSERVE_BASE_IMAGE": "compose.yaml: the Dockerfile's BASE_IMAGE when compose builds (default python:3.11-slim)",
    "MMSERVE_CUDA_WHEELS": "compose.yaml: the Dockerfile's CUDA build argument when compose builds (default 1)",
    "MMSERVE_REDIS_IMAGE": "compose.yaml, scripts/docker_base.sh: the Redis image (default redis:7-alpine)",
    "MMSERVE_BIND": "compose.yaml: the host address the gateway's port is published on (default 0.0.0.0)",
    "MMSERVE_MEM_REDIS": "compose.yaml: Redis's memory limit (default 2560m)",
    "MMSERVE_MEM_ENCODER": "compose.yaml: each encoder's memory limit (default 4g)",
    "MMSERVE_MEM_LLM": "compose.yaml: each LLM replica's memory limit (default 8g)",
    "MMSERVE_MEM_GATEWAY": "compose.yaml: the gateway's memory limit (default 2g)",
    "MMSERVE_CPUS_ENCODER": "compose.yaml: each encoder's CPU limit (default 2)",
    "MMSERVE_CPUS_LLM": "compose.yaml: each LLM replica's CPU limit (default 2)",
    "MMSERVE_CPUS_GATEWAY": "compose.yaml: the gateway's CPU limit (default 2)",
    "MMSERVE_GRAFANA_ADMIN_PASSWORD": "compose.yaml (.env, monitoring profile): Grafana's admin password",
    "MMSERVE_KERNEL_PREBUILT": "the LLM service (llm_svc/kernels/ckernels.py): a directory of C kernels prebuilt "
    "per x86-64 level, loaded where no compiler runs (the image sets /opt/mmserve/kernels)",
    "MMSERVE_COMPOSE": "benchmarks/_compose_util.py: the Compose command (default docker-compose; 'docker compose' for v2)",
    "MMSERVE_WHEELHOUSE_PORT": "scripts/docker_build.sh: the port the wheelhouse is served on for a build (default 18765)",
    "MMSERVE_SCREENSHOT_DIR": "tests/e2e/test_dashboard.py: where the dashboard screenshots go",
}


def service_settings() -> dict[str, type[BaseSettings]]:
    """Every service's settings model by service name."""
    from shared.settings import EncoderSettings, GatewaySettings, LLMSettings

    return {"gateway": GatewaySettings, "encoder": EncoderSettings, "llm": LLMSettings}


def env_prefix(settings_cls: type[BaseSettings]) -> str:
    return settings_cls.model_config.get("env_prefix", "").upper()


def env_name(settings_cls: type[BaseSettings], field: str) -> str:
    """The variable of one field (the first, where an alias gives it several)."""
    return env_names_of(settings_cls, field)[0]


def env_names_of(settings_cls: type[BaseSettings], field: str) -> list[str]:
    """The variables a field is read from: its alias(es) as they stand, else prefix + name."""
    info = settings_cls.model_fields[field]
    alias = info.validation_alias or info.alias
    if isinstance(alias, str):
        return [alias.upper()]
    if isinstance(alias, AliasChoices):
        return [c.upper() for c in alias.choices if isinstance(c, str)]
    return [env_prefix(settings_cls) + field.upper()]


def env_names(settings_cls: type[BaseSettings]) -> dict[str, str]:
    """Variable -> field, for every field of ``settings_cls``."""
    return {name: field for field in settings_cls.model_fields for name in env_names_of(settings_cls, field)}


def known_names() -> set[str]:
    """Every MMSERVE_* variable that means something to some part of mmserve."""
    names = set(OTHER_VARS)
    for cls in service_settings().values():
        names |= set(env_names(cls))
    return names


def nearest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate most like ``name`` (difflib's ratio), None when there is none."""
    best = difflib.get_close_matches(name, sorted(candidates), n=1, cutoff=0.0)
    return best[0] if best else None


def unknown_message(name: str, service: str, mine: Mapping[str, str]) -> str:
    """What one unknown variable is told: the nearest real name, and which other services have a
    setting of that field name (``MMSERVE_LLM_MAX_QUEUE``: the encoder's and the gateway's)."""
    msg = f"{name} names no setting of {LABELS.get(service, 'the ' + service)}"
    guess = nearest(name, [*mine, *OTHER_VARS])
    if guess:
        msg += f"; nearest: {guess}"
        if guess in mine and service != "up":  # mmserve up has its own flags
            msg += f" (--{mine[guess].replace('_', '-')})"
    owner, prefix = next(((s, env_prefix(c)) for s, c in service_settings().items()
                          if name.startswith(env_prefix(c))), (None, ""))
    field = name[len(prefix):].lower()
    elsewhere = [LABELS[s].removeprefix("the ") for s, cls in service_settings().items()
                 if owner and s != owner and field in cls.model_fields]
    if elsewhere:
        msg += f"; {field} is a setting of the {' and the '.join(elsewhere)}"
    return msg + "; every setting: docs/configuration.md"


def _service_prefixes() -> list[str]:
    return sorted({env_prefix(cls) for cls in service_settings().values()}, key=len, reverse=True)


def check_env(service: str, settings_classes: Sequence[type[BaseSettings]], environ: Mapping[str, str],
              strict: bool) -> list[str]:
    """Check the ``MMSERVE_*`` variables of ``environ`` against the settings of ``service`` (its
    ``settings_classes``; ``mmserve up``: all of them). Logs one warning per unknown variable and
    returns the messages; with ``strict`` logs them as errors and exits with ``EXIT_CODE``."""
    mine: dict[str, str] = {}
    for cls in settings_classes:
        mine.update(env_names(cls))
    my_prefixes = {env_prefix(cls) for cls in settings_classes}
    other_prefixes = [p for p in _service_prefixes() if p not in my_prefixes]
    everyone = known_names()
    problems = []
    for key in sorted(environ):
        name = key.upper()  # pydantic-settings reads variables case-insensitively
        if not name.startswith(PREFIX) or name in mine or name in OTHER_VARS:
            continue
        if name in everyone:
            log.debug("%s is a setting of another service, not of %s", name, service)
        elif any(name.startswith(p) for p in other_prefixes):
            log.debug("%s: left to its own service to check", name)
        else:
            problems.append(unknown_message(name, service, mine))
    for msg in problems:
        log.log(logging.ERROR if strict else logging.WARNING, "%s", msg)
    if problems and strict:
        log.error("%d unknown MMSERVE_* variable(s) under %s / %s=1: not starting",
                  len(problems), STRICT_FLAG, STRICT_VAR)
        raise SystemExit(EXIT_CODE)
    return problems


def strict_requested(flag: bool, environ: Mapping[str, str]) -> bool:
    """``--strict-env`` given, or ``MMSERVE_STRICT_ENV`` set to a true value."""
    return flag or environ.get(STRICT_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def check_service_env(service: str, strict: bool | None = None, environ: Mapping[str, str] | None = None) -> list[str]:
    """The start-up hook of ``service`` (``gateway``, ``encoder``, ``llm``, or ``up`` for all of
    them) on this process's environment. ``strict`` None: ``--strict-env`` among ``sys.argv``
    (for ``python -m gateway``, which has no other flags)."""
    env = os.environ if environ is None else environ
    classes = service_settings()
    settings_classes = list(classes.values()) if service == "up" else [classes[service]]
    flag = STRICT_FLAG in sys.argv[1:] if strict is None else strict
    return check_env(service, settings_classes, env, strict_requested(flag, env))
