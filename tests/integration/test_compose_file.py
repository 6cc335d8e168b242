"""compose.yaml is exercised without Docker: parsed, checked, and its services run as processes."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import httpx
import pytest

from mmserve.compose_local import load_compose, local_services, redis_already_running
from mmserve.launcher import wait_ready
from tests.conftest import make_png

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def compose(mimo_bundle):
    env = {**os.environ, "MMSERVE_MODEL_DIR": str(mimo_bundle), "MMSERVE_DEVICE": "cpu"}
    return load_compose(ROOT / "compose.yaml", env)


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
        (vol,) = svcs[name]["volumes"]
        assert vol["read_only"] is True and vol["source"] == str(mimo_bundle), name
        assert "ports" not in svcs[name], f"{name} must not publish a port, or --scale collides"
    assert (ROOT / "Dockerfile").exists()


def test_gpu_override_reserves_a_gpu_per_replica_and_defaults_to_cuda(mimo_bundle):
    base = load_compose(ROOT / "compose.yaml", {"MMSERVE_MODEL_DIR": str(mimo_bundle)})
    gpu = load_compose(ROOT / "compose.gpu.yaml", {})
    assert base["services"]["encoder"]["environment"]["MMSERVE_ENCODER_DEVICE"] == "cpu"
    for name, var in (("encoder", "MMSERVE_ENCODER_DEVICE"), ("llm", "MMSERVE_LLM_DEVICE")):
        svc = gpu["services"][name]
        dev = svc["deploy"]["resources"]["reservations"]["devices"][0]
        assert dev["capabilities"] == ["gpu"] and dev["driver"] == "nvidia", name
        assert svc["environment"][var] == "cuda", name
        assert name in base["services"], f"the override names a service compose.yaml lacks: {name}"
    assert set(gpu["services"]) == {"encoder", "llm"}


def test_compose_services_run_as_local_processes(compose, tmp_path):
    if not redis_already_running(compose):
        pytest.fail("Redis must be running on 127.0.0.1:6379 for the compose test")
    services = local_services(compose, ROOT, tmp_path, order=["encoder", "llm", "gateway"])
    try:
        for svc in services:
            svc.start()
        wait_ready(services, timeout=240)
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
    finally:
        for svc in reversed(services):
            svc.stop()


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
