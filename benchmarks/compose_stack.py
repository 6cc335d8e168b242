"""compose_stack: the container path's cost. The same chat load (closed-loop clients, text chats
of ``--max-tokens`` output tokens with ``ignore_eos``, greedy) through compose.yaml's stack on this
machine's Docker engine and through ``mmserve up``'s local processes, 1 encoder and 2 LLM
replicas each, on the tiny model, with the same features on both sides: the local stack gets a
Redis too (``--redis-url``, this machine's), so its LLMs write the L3 KV tier, publish KV events
and sign what they store as compose's do, and only the container path differs. The sides
alternate A-B-B-A (local, compose, compose, local, ...), each run in a fresh stack. Reported: output tok/s per side (median over rounds) and
``figures.ratios.compose_over_local`` (target >= 0.9: the container path costs little), and the
image build time: warm (``docker build`` with every layer cached, what a CI run with unchanged
sources pays) and, in full mode, cold (``--no-cache``, the base images and wheelhouse already
there). The image is built offline (scripts/docker_build.sh). The last line is JSON.

    python -m benchmarks.compose_stack --quick     # two runs per side, warm build only (~6 min)
    python -m benchmarks.compose_stack             # two rounds per side, cold + warm builds
    python -m benchmarks.compose_stack --smoke     # local side only, compose.yaml checked by the engine's compose

Both sides run on the same 2 cores: the containers' CPU limit (``cpus``) is 2, the LLM replicas use
the kernels the image prebuilt for the highest x86-64 level this CPU runs, the local side the
host's ``-march=native`` builds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks import _results
from benchmarks._compose_util import ROOT, ComposeProject, build_image, compose_cmd, readable_bundle

TARGET = 0.9


async def chat_load(url: str, model: str, clients: int, requests: int, max_tokens: int) -> dict:
    """``requests`` chats from ``clients`` closed-loop clients: output tok/s over the wall time."""
    done = {"tokens": 0, "ok": 0, "errors": 0}
    todo = iter(range(requests))

    async def client(http: httpx.AsyncClient) -> None:
        for i in todo:
            body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"Request {i}: tell me about the number {i * 7919}."}]}
            r = await http.post(f"{url}/v1/chat/completions", json=body, timeout=300)
            if r.status_code == 200:
                done["ok"] += 1
                done["tokens"] += r.json()["usage"]["completion_tokens"]
            else:
                done["errors"] += 1

    async with httpx.AsyncClient() as http:
        await client_warmup(http, url, model)
        t0 = time.monotonic()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        wall = time.monotonic() - t0
    return {**done, "seconds": round(wall, 2), "tok_s": round(done["tokens"] / wall, 1)}


async def client_warmup(http: httpx.AsyncClient, url: str, model: str) -> None:
    for _ in range(4):  # both LLM replicas see a first request before the clock starts
        await http.post(f"{url}/v1/chat/completions", timeout=300, json={
            "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "warm up"}]})


def local_side(bundle: Path, args, log_dir: Path) -> dict:
    from mmserve.launcher import LocalStack, StackSpec

    spec = StackSpec(model_dir=str(bundle), gateway_port=0, encoders=1, llms=2, redis_url=args.redis_url or None)
    with LocalStack(spec, log_dir=log_dir) as s:
        s.wait_ready(timeout=300)
        return asyncio.run(chat_load(s.url, s.model_name, args.clients, args.requests, args.max_tokens))


def compose_side(bundle: Path, image: dict, args) -> dict:
    p = ComposeProject(bundle, image=image["image"], redis_image=image["redis_image"],
                       name="mmserve-bench-compose")
    try:
        p.up(encoders=1, llms=2)
        model = httpx.get(f"{p.url}/v1/models", timeout=10).json()["data"][0]["id"]
        return asyncio.run(chat_load(p.url, model, args.clients, args.requests, args.max_tokens))
    finally:
        p.down()


def compose_config_ok() -> bool:
    """compose.yaml as the installed Compose reads it (secrets set), without starting anything."""
    env = {"MMSERVE_REDIS_PASSWORD": "x", "MMSERVE_PEER_KEY": "x", "MMSERVE_SERVICE_TOKEN": "x", "PATH": "/usr/bin:/bin"}
    try:
        r = subprocess.run([*compose_cmd(), "-f", str(ROOT / "compose.yaml"), "config", "-q"], env=env,
                           capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        return False
    return r.returncode == 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None, help="A-B-B-A rounds: 2 runs per side each (default 2; --quick 1)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=None, help="chats per run (default 320; --quick 160)")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0",
                    help="the local stack's Redis (compose runs its own); empty: none (the embedded cache)")
    ap.add_argument("--max-tokens", type=int, default=32)
    _results.add_mode_args(ap)
    args = ap.parse_args()
    mode = _results.mode_of(args)
    rounds = args.rounds or {"smoke": 1, "quick": 1, "full": 2}[mode]
    args.requests = args.requests or {"smoke": 4, "quick": 160, "full": 320}[mode]
    if mode == "smoke":
        args.clients = min(args.clients, 2)

    from mmserve.tiny_model import write_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="mmserve-compose-bench-"))
    bundle = readable_bundle(write_tiny_model(tmp / "tiny-mimo", arch="mimo"))
    out: dict = {"rounds": rounds, "clients": args.clients, "requests": args.requests, "max_tokens": args.max_tokens}
    skipped: list[str] = []
    sides: dict[str, list[dict]] = {"local": [], "compose": []}
    if mode == "smoke":
        sides["local"].append(local_side(bundle, args, tmp / "logs"))
        out["compose_config_ok"] = compose_config_ok()
        skipped.append("the compose side and the image builds: minutes of docker build and container start "
                       "(tests/e2e/test_compose_stack.py runs them in CI)")
    else:
        if mode == "full":  # every layer rebuilt (the base images and the wheelhouse kept)
            out["build_cold_s"] = build_image("mmserve:latest", no_cache=True)["build_s"]
        warm = build_image("mmserve:latest")
        out["build_warm_s"] = warm["build_s"]
        for r in range(rounds):  # A-B-B-A
            sides["local"].append(local_side(bundle, args, tmp / f"logs-{r}a"))
            sides["compose"].append(compose_side(bundle, warm, args))
            sides["compose"].append(compose_side(bundle, warm, args))
            sides["local"].append(local_side(bundle, args, tmp / f"logs-{r}b"))
    for side, runs in sides.items():
        if runs:
            out[side] = {"tok_s": statistics.median(x["tok_s"] for x in runs), "runs": runs}
            assert all(x["errors"] == 0 for x in runs), runs
    ratios = {}
    if sides["compose"]:
        ratios["compose_over_local"] = round(out["compose"]["tok_s"] / out["local"]["tok_s"], 3)
        out["target"] = {"compose_over_local": f">= {TARGET}"}
        out["met"] = ratios["compose_over_local"] >= TARGET
    out["ratios"] = ratios
    summary = (f"output tok/s through compose / through local processes, 2 LLM replicas each: "
               f"**{ratios['compose_over_local']:.2f}x** ({out['compose']['tok_s']} vs {out['local']['tok_s']}); "
               f"image build warm {out['build_warm_s']} s"
               + (f", cold {out['build_cold_s']} s" if "build_cold_s" in out else "")
               if ratios else f"local side only (smoke): {out['local']['tok_s']} tok/s")
    _results.record("compose_stack", ap, args, out, kind="wall-clock",
                    baseline="the same stack as local processes (mmserve up)", summary=summary, skipped=skipped)
    return 0


if __name__ == "__main__":
    _results.run(main)
