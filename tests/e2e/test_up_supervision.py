"""``mmserve up`` keeps a stack alive (issue 11 item 4): SIGKILL one of two encoders under load;
every request still succeeds (the gateway fails over), ``up`` logs the exit and restarts the
encoder on its port, it serves again, and ``up`` keeps running until told to stop (then 0)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from benchmarks._stack_util import image_part, make_png, user
from mmserve.launcher import free_port

pytestmark = pytest.mark.e2e


def _pid_serving(port: int) -> int:
    """The pid of our encoder process listening on ``port`` (from its command line)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"encoder" in argv and b"--port" in argv and argv[argv.index(b"--port") + 1] == str(port).encode():
            return int(d.name)
    raise LookupError(f"no encoder on port {port}")


class Output:
    """Collects the lines ``up`` prints, in a thread."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._t = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._t.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines:
                if m := re.search(pattern, line):
                    return m
            time.sleep(0.1)
        raise AssertionError(f"{pattern!r} not printed in {timeout} s:\n" + "\n".join(self.lines[-40:]))


def test_sigkill_of_an_encoder_under_up_loses_no_request(mimo_bundle):
    port = free_port()
    env = {**os.environ, "MMSERVE_GATEWAY_HEALTH_INTERVAL": "0.5", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mmserve.cli", "up", "--model", str(mimo_bundle), "--port", str(port),
         "--encoders", "2", "--llms", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
    )
    out = Output(proc)
    try:
        urls = dict(re.findall(r"(encoder-\d)=(http://\S+?)(?:,|$)", out.wait_for(r"services: .*", 300).group(0)))
        victim_port = int(urls["encoder-1"].rsplit(":", 1)[1])
        url = f"http://127.0.0.1:{port}/v1/chat/completions"

        def one(i: int) -> int:
            body = {"model": mimo_bundle.name, "max_tokens": 2,
                    "messages": [user("Describe.", image_part(make_png(seed=100 + i)))]}
            return httpx.post(url, json=body, timeout=120).status_code

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(one, i) for i in range(40)]
            time.sleep(1.0)
            os.kill(_pid_serving(victim_port), signal.SIGKILL)
            statuses = [f.result() for f in futures]
        assert statuses == [200] * 40
        out.wait_for(r"encoder-1 exited with code -9; restarting", 30)
        out.wait_for(r"encoder-1 is ready again", 180)
        assert httpx.get(f"{urls['encoder-1']}/readyz", timeout=10).status_code == 200
        assert proc.poll() is None  # the stack was not torn down
        assert one(1000) == 200
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    assert code == 0
