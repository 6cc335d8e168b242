"""compose.yaml is exercised without Docker: parsed, checked, and its services run as processes."""

from __future__ import annotations

import base64
import os
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from mmserve.compose_local import MissingVariable, load_compose, local_services, redis_already_running
from mmserve.launcher import wait_ready
from tests.conftest import make_png
from tests.redis_acl import acl_user, clients_of

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SECRETS = ("MMSERVE_REDIS_PASSWORD", "MMSERVE_PEER_KEY", "MMSERVE_SERVICE_TOKEN")


def dot_env(**extra: str) -> dict[str, str]:
    """What .env holds once made as .env.example says (a fresh value per secret)."""
    import secrets

    return {**{k: secrets.token_hex(32) for k in SECRETS}, **extra}


@pytest.fixture
def redis_user():
    """Redis with a password, as compose runs it: an ACL user of the shared test Redis (its
    default user, which other tests use, keeps no password)."""
    with acl_user() as user:
        yield user


@pytest.fixture
def compose(mimo_bundle, redis_user):
    env = {**os.environ, "MMSERVE_MODEL_DIR": str(mimo_bundle), "MMSERVE_DEVICE": "cpu",
           **dot_env(MMSERVE_REDIS_USER=redis_user.name, MMSERVE_REDIS_PASSWORD=redis_user.password)}
    return load_compose(ROOT / "compose.yaml", env)


@contextmanager
def running(compose: dict, tmp_path, order: list[str]):
    """``compose``'s services in ``order`` as local processes, ready; stopped (in reverse) after."""
    if not redis_already_running(compose):
        pytest.fail("Redis must be running on 127.0.0.1:6379 for the compose test")
    services = local_services(compose, ROOT, tmp_path, order=order)
    try:
        for svc in services:
            svc.start()
        wait_ready(services, timeout=240)
        yield services
    finally:
        for svc in reversed(services):
            svc.stop()


def test_compose_refuses_to_start_without_its_secrets(mimo_bundle):
    base = {"MMSERVE_MODEL_DIR": str(mimo_bundle)}
    for missing in SECRETS:
        env = {**base, **dot_env()}
        env[missing] = ""  # as .env.example ships it
        with pytest.raises(MissingVariable, match=missing):
            load_compose(ROOT / "compose.yaml", env)
    example = (ROOT / ".env.example").read_text()
    for name in SECRETS:  # shipped empty, never with a usable value
        assert f"\n{name}=\n" in example, name
    assert "openssl rand -hex 32" in example
    assert "/.env" in (ROOT / ".gitignore").read_text().split() and ".env" in (ROOT / ".dockerignore").read_text().split()


def test_every_service_authenticates_to_redis_and_its_peers(mimo_bundle):
    env = {"MMSERVE_MODEL_DIR": str(mimo_bundle), **dot_env()}
    svcs = load_compose(ROOT / "compose.yaml", env)["services"]
    pw = env["MMSERVE_REDIS_PASSWORD"]
    cmd = svcs["redis"]["command"]
    assert cmd[cmd.index("--requirepass") + 1] == pw
    assert svcs["redis"]["environment"]["REDISCLI_AUTH"] == pw  # the healthcheck's ping authenticates
    assert "grep -q PONG" in svcs["redis"]["healthcheck"]["test"][-1]  # NOAUTH is no PONG
    redis_urls = [(n, k, v) for n in ("encoder", "llm", "gateway") for k, v in svcs[n]["environment"].items()
                  if k.endswith("_URL") and str(v).startswith("redis")]
    assert len(redis_urls) == 5
    for n, k, v in redis_urls:
        assert v == f"redis://default:{pw}@redis:6379/0", (n, k)
    for n in ("encoder", "llm", "gateway"):
        e = svcs[n]["environment"]
        assert e[f"MMSERVE_{n.upper()}_PEER_KEY"] == env["MMSERVE_PEER_KEY"], n
        assert e[f"MMSERVE_{n.upper()}_SERVICE_TOKEN"] == env["MMSERVE_SERVICE_TOKEN"], n
    # the LLMs fetch media only from the encoder replicas (the service name, resolved to every replica)
    assert svcs["llm"]["environment"]["MMSERVE_LLM_MEDIA_FETCH_ALLOW"] == "encoder:8100"
    assert svcs["gateway"]["environment"]["MMSERVE_GATEWAY_ENCODER_URLS"] == "http://encoder:8100"


def test_compose_declares_the_topology(compose, mimo_bundle):
    svcs = {n: s for n, s in compose["services"].items() if not s.get("profiles")}
    assert set(svcs) == {"redis", "encoder", "llm", "gateway"}  # monitoring: tests/unit/test_monitoring.py
    for name in svcs:
        assert svcs[name]["healthcheck"]["test"], name
    assert svcs["gateway"]["depends_on"] == {
        "encoder": {"condition": "service_healthy"},
        "llm": {"condition": "service_healthy"},
    }
    assert svcs["encoder"]["depends_on"]["redis"]["condition"] == "service_healthy"
    for name in ("encoder", "llm"):
        # no device reservation in the base file: `docker compose up` starts without NVIDIA
        assert "resources" not in svcs[name]["deploy"], name
        assert "replicas" in svcs[name]["deploy"], name
        bundle, cache = svcs[name]["volumes"]
        assert bundle["read_only"] is True and bundle["source"] == str(mimo_bundle), name
        assert cache == {"type": "volume", "source": "cache", "target": "/var/cache/mmserve"}, name
        assert "ports" not in svcs[name], f"{name} must not publish a port, or --scale collides"
    assert (ROOT / "Dockerfile").exists()


def test_compose_runs_on_v1_and_hardens_every_service(compose):
    """No top-level name: (Compose v1 refuses it); every core service read-only, without
    capabilities, restarted, memory-bounded; only the gateway publishes a port, monitoring only on
    loopback; the LLM's parallel settings default to one rank."""
    assert "name" not in compose and set(compose["volumes"]) == {"cache"}
    svcs = compose["services"]
    for name in ("redis", "encoder", "llm", "gateway"):
        s = svcs[name]
        assert s["read_only"] is True and s["cap_drop"] == ["ALL"], name
        assert s["security_opt"] == ["no-new-privileges:true"] and s["tmpfs"] == ["/tmp:size=512m"], name
        assert s["restart"] == "unless-stopped" and s["mem_limit"] and s["pids_limit"], name
        assert ("ports" in s) == (name == "gateway"), name
    for name in ("prometheus", "grafana"):
        assert all(p.startswith("127.0.0.1:") for p in svcs[name]["ports"]), name
    assert "GF_SECURITY_ADMIN_PASSWORD" in svcs["grafana"]["environment"]
    for name in ("encoder", "llm", "gateway"):
        assert svcs[name]["image"] == "mmserve:latest" and svcs[name]["build"]["args"]["BASE_IMAGE"] == "python:3.11-slim"
    assert svcs["redis"]["image"] == "redis:7-alpine"
    env = svcs["llm"]["environment"]
    assert (env["MMSERVE_LLM_TENSOR_PARALLEL_SIZE"], env["MMSERVE_LLM_ENABLE_EXPERT_PARALLEL"],
            env["MMSERVE_LLM_DATA_PARALLEL_SIZE"]) == ("1", "false", "1")
    from shared.settings import LLMSettings

    s = LLMSettings(model_dir="/models/bundle", **{k.removeprefix("MMSERVE_LLM_").lower(): v for k, v in env.items()
                       if k.endswith(("PARALLEL_SIZE", "EXPERT_PARALLEL"))})
    assert (s.tensor_parallel_size, s.enable_expert_parallel, s.data_parallel_size) == (1, False, 1)


def test_gpu_override_reserves_a_gpu_per_replica_and_defaults_to_cuda(mimo_bundle):
    base = load_compose(ROOT / "compose.yaml", {"MMSERVE_MODEL_DIR": str(mimo_bundle), **dot_env()})
    gpu = load_compose(ROOT / "compose.gpu.yaml", {})
    assert base["services"]["encoder"]["environment"]["MMSERVE_ENCODER_DEVICE"] == "cpu"
    for name, var in (("encoder", "MMSERVE_ENCODER_DEVICE"), ("llm", "MMSERVE_LLM_DEVICE")):
        svc = gpu["services"][name]
        dev = svc["deploy"]["resources"]["reservations"]["devices"][0]
        assert dev["capabilities"] == ["gpu"] and dev["driver"] == "nvidia", name
        assert svc["environment"][var] == "cuda", name
        assert name in base["services"], f"the override names a service compose.yaml lacks: {name}"
    assert set(gpu["services"]) == {"encoder", "llm"}


def test_compose_services_run_as_local_processes(compose, redis_user, tmp_path):
    """The stack as compose runs it, against Redis with a password (an ACL user here): every
    service connects as that user, and a chat with an image is answered."""
    with running(compose, tmp_path, ["encoder", "llm", "gateway"]) as services:
        gateway = services[-1]
        png = make_png(seed=7)
        body = {
            "model": compose["services"]["gateway"]["environment"]["MMSERVE_GATEWAY_MODEL_NAME"],
            "max_tokens": 6,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}},
                    ],
                }
            ],
        }
        r = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["object"] == "chat.completion"
        assert out["usage"]["completion_tokens"] >= 1
        assert clients_of(redis_user) > 0  # the services hold Redis connections as the .env's user
        llm = services[1]
        m = httpx.get(f"{llm.url}/metrics", timeout=10).text
        assert 'mmserve_peer_auth_failures_total{source="kv_page"} 0.0' in m
        assert 'mmserve_peer_auth_failures_total{source="embedding"} 0.0' in m


def test_launcher_fails_fast_when_a_service_cannot_load(tmp_path):
    """A bundle that does not load makes wait_ready raise with the service's log at once,
    instead of polling /readyz until the timeout."""
    import time

    from mmserve.launcher import LocalStack, StackSpec

    bad = tmp_path / "bad-bundle"
    bad.mkdir()
    (bad / "config.json").write_text('{"architectures": ["NoSuchModelForCausalLM"]}')
    t0 = time.monotonic()
    with LocalStack(StackSpec(model_dir=str(bad), gateway_port=0), log_dir=tmp_path / "logs") as stack:
        with pytest.raises(RuntimeError, match="(failed to load|exited early)"):
            stack.wait_ready(timeout=120)
    assert time.monotonic() - t0 < 100


def test_disagg_override_runs_prefill_and_decode_replicas_behind_the_gateway(mimo_bundle, redis_user, tmp_path):
    """compose.yaml + compose.disagg.yaml as local processes (compose's merge of the two files):
    a long text chat through the gateway is prefilled on `llm-prefill`, its KV handed over to
    `llm` (role decode) and answered; the hardening and the scaling knobs carry over."""
    from mmserve.launcher import free_port

    env = {**os.environ, "MMSERVE_MODEL_DIR": str(mimo_bundle), "MMSERVE_DEVICE": "cpu",
           "MMSERVE_HANDOVER_PORT": str(free_port()),
           **dot_env(MMSERVE_REDIS_USER=redis_user.name, MMSERVE_REDIS_PASSWORD=redis_user.password)}
    compose = load_compose([ROOT / "compose.yaml", ROOT / "compose.disagg.yaml"], env)
    svcs = compose["services"]
    assert svcs["llm"]["environment"]["MMSERVE_LLM_ROLE"] == "decode"
    assert svcs["llm"]["environment"]["MMSERVE_LLM_KV_L3_URL"].startswith("redis://")  # merged, not replaced
    pre = svcs["llm-prefill"]
    assert pre["environment"]["MMSERVE_LLM_ROLE"] == "prefill" and "replicas" in pre["deploy"]
    assert pre["read_only"] is True and pre["cap_drop"] == ["ALL"] and "ports" not in pre
    assert svcs["gateway"]["depends_on"]["llm-prefill"] == {"condition": "service_healthy"}
    # each names the other as its only hand-over peers (a scaled service's name: its replicas)
    assert svcs["llm"]["environment"]["MMSERVE_LLM_KV_PEER_ALLOW"] == "llm-prefill:8210"
    assert pre["environment"]["MMSERVE_LLM_KV_PEER_ALLOW"] == f"llm:{env['MMSERVE_HANDOVER_PORT']}"
    assert svcs["gateway"]["depends_on"]["llm"] == {"condition": "service_healthy"}
    with running(compose, tmp_path, ["encoder", "llm-prefill", "llm", "gateway"]) as services:
        gateway, decode = services[-1], services[2]
        text = "Read these notes closely. " + " ".join(f"note {i}: the tide turned at dawn." for i in range(60))
        body = {"model": svcs["gateway"]["environment"]["MMSERVE_GATEWAY_MODEL_NAME"], "max_tokens": 6,
                "messages": [{"role": "user", "content": text}]}
        r = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
        g = httpx.get(f"{gateway.url}/metrics", timeout=10).text
        assert 'mmserve_gateway_disagg_decisions_total{decision="remote"} 1.0' in g
        m = httpx.get(f"{decode.url}/metrics", timeout=10).text
        assert 'mmserve_llm_handover{event="adopted"} 1.0' in m
        assert 'mmserve_llm_remote_prefill_total{outcome="handed_over"} 1.0' in m
