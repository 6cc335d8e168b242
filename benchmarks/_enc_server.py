"""Encoder servers in subprocesses (own GIL, own torch threads) for the encoder benchmarks.

``python -m benchmarks._enc_server --port P`` serves ``create_app(EncoderSettings())`` (settings
from ``MMSERVE_ENCODER_*``); ``spawn_encoder(**settings)`` starts one and yields its URL.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from typing import Iterator

import httpx

from encoder_svc.server import free_port


@contextlib.contextmanager
def spawn_encoder(startup_timeout: float = 180.0, **settings) -> Iterator[str]:
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.update({f"MMSERVE_ENCODER_{k.upper()}": str(v) for k, v in settings.items()})
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks._enc_server", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"encoder server exited with {proc.returncode}")
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("encoder server did not become ready")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def forward_passes(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == "encoder_forward_passes_total":
                total += s.value
    return total


def main() -> None:
    import uvicorn

    from encoder_svc.app import create_app
    from shared.settings import EncoderSettings

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    uvicorn.run(create_app(EncoderSettings()), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
