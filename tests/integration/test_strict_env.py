"""A real service process and a mistyped variable (issue 43, item 8): with ``--strict-env`` (or
``MMSERVE_STRICT_ENV=1``) it exits with code 2 naming the nearest setting before it serves; without,
it serves and its log has the same message as a warning."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from mmserve.launcher import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TYPO = {"MMSERVE_GATEWAY_FAIL_THRESHOLD": "5"}
NEAREST = "nearest: MMSERVE_GATEWAY_HEALTH_FAIL_THRESHOLD (--health-fail-threshold)"


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("MMSERVE_")}
    return {**env, "HF_HUB_OFFLINE": "1", **extra}


def test_python_m_gateway_with_strict_env_exits_2_naming_the_setting():
    r = subprocess.run([sys.executable, "-m", "gateway", "--strict-env"], cwd=ROOT, env=clean_env(**TYPO),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"MMSERVE_GATEWAY_FAIL_THRESHOLD names no setting of the gateway; {NEAREST}" in r.stderr


def test_strict_from_the_environment_stops_a_model_service_before_it_loads():
    r = subprocess.run([sys.executable, "-m", "mmserve.cli", "encoder", "--model", "/nonexistent"], cwd=ROOT,
                       env=clean_env(MMSERVE_STRICT_ENV="1", MMSERVE_ENCODER_VIDEO_FRAMES="8"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "MMSERVE_ENCODER_VIDEO_FRAMES names no setting of the encoder; nearest: MMSERVE_ENCODER_VIDEO_" in r.stderr


def test_without_strict_the_gateway_serves_and_logs_the_warning(tmp_path):
    port, log_path = free_port(), tmp_path / "gateway.log"
    argv = [sys.executable, "-m", "mmserve.cli", "gateway", "--port", str(port), "--health-interval", "0",
            "--dns-interval", "0"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=clean_env(**TYPO), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    warnings = [line for line in log_path.read_text().splitlines() if "mmserve.env WARNING" in line]
    assert len(warnings) == 1 and NEAREST in warnings[0]
