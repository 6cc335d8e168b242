"""The README's two quickstart commands stay true: run.sh starts a stack whose curl works."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from mmserve.launcher import free_port

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def _quickstart_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Quickstart", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.split("#")[0].strip() for line in block.strip().splitlines()]


def test_readme_has_two_commands_and_ci_runs_the_test_one():
    run_cmd, test_cmd = _quickstart_commands()
    assert run_cmd == "bash scripts/run.sh"
    assert test_cmd == "bash scripts/test.sh"
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_run_command_starts_a_stack_whose_printed_curl_answers(tmp_path):
    run_cmd, _ = _quickstart_commands()
    port = free_port()
    env = {**os.environ, "MMSERVE_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.Popen(
        shlex.split(run_cmd) + ["--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 300
        curl = None
        while time.monotonic() < deadline and curl is None:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("curl "):
                curl = line.strip()
        assert curl, "no curl printed:\n" + "".join(lines[-50:])
        # startup a person can read: one progress line per service, no per-poll HTTP logs
        assert not [ln for ln in lines if "HTTP Request" in ln or "/readyz" in ln], "".join(lines)
        ready = [ln for ln in lines if re.match(r"\s+(encoder|llm|gateway)\S*\s+ready\b", ln)]
        assert len(ready) == 3, "".join(lines)
        # from `mmserve up`'s first line to the curl: the ready lines and the banner, nothing else
        # (setup.sh and first-use model writing may print before it)
        start = next(i for i, ln in enumerate(lines) if ln.startswith("starting "))
        assert len(lines) - start < 12, "".join(lines[start:])
        assert f":{port}/v1/chat/completions" in curl
        out = subprocess.run(curl, shell=True, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert re.search(r'"object"\s*:\s*"chat.completion"', out.stdout), out.stdout
        assert '"completion_tokens"' in out.stdout
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)
