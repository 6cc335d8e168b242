"""NVIDIA's aiperf (a real load client, its own venv) against the README's stack: streamed chat
with images, some requests cancelled by the client; reports aiperf's TTFT / ITL / throughput.

Wall-clock, one side (our stack; ``benchmarks.vs_vllm`` compares with vLLM). The stack is what
``bash scripts/run.sh`` starts (gateway + one encoder + one LLM service, the default tiny model),
started here on a free port. aiperf 0.13 runs from ``~/.cache/mmserve/aiperf-venv``
(``bash scripts/load_clients.sh aiperf`` makes it); the tokenizer is the model directory's own.
Output lengths are held with ``ignore_eos`` (a vLLM extension our gateway accepts): the usage
every response reports is exactly ``--output-tokens``. aiperf is told to count with it
(``--use-server-token-count``); its own re-tokenization of a random-weight model's text counts
more tokens than were generated (token ids do not round-trip through text), printed beside it. The same command works against any running stack:

    python -m benchmarks.aiperf_chat [--quick] [--url http://127.0.0.1:8000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

from benchmarks import _results
from shared.cache_dir import cache_root

CACHE = cache_root()
AIPERF = CACHE / "aiperf-venv" / "bin" / "aiperf"
METRICS = {  # aiperf's export name -> our label
    "time_to_first_token": "TTFT",
    "inter_token_latency": "ITL",
    "request_latency": "request latency",
    "output_token_throughput": "output tokens/s",
    "request_throughput": "requests/s",
    "output_sequence_length": "output tokens/request",
    "usage_completion_tokens": "usage completion tokens",
}


def aiperf_command(url: str, model: str, tokenizer: str, out: Path, requests: int, concurrency: int,
                   cancel_pct: float, image_px: int, output_tokens: int) -> list[str]:
    return [
        str(AIPERF), "profile",
        "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming",
        "--tokenizer", tokenizer,
        "--image-width-mean", str(image_px), "--image-height-mean", str(image_px), "--image-batch-size", "1",
        "--image-format", "png",
        "--synthetic-input-tokens-mean", "64", "--synthetic-input-tokens-stddev", "0",
        "--output-tokens-mean", str(output_tokens), "--output-tokens-stddev", "0",
        "--extra-inputs", "ignore_eos:true",
        # the server's usage counts: re-tokenizing a random model's text gives ~25% more tokens
        # than were generated (ids do not round-trip), which would inflate tok/s and shrink ITL
        "--use-server-token-count",
        "--request-count", str(requests), "--concurrency", str(concurrency),
        "--request-cancellation-rate", str(cancel_pct), "--request-cancellation-delay", "0.2",
        "--random-seed", "0", "--artifact-dir", str(out), "--ui-type", "none",
    ]  # fmt: skip


def run_aiperf(cmd: list[str], out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    # (a local tokenizer path fails to load under HF_HUB_OFFLINE=1 in aiperf 0.13; nothing is fetched)
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    if p.returncode != 0:
        raise SystemExit(f"aiperf failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    found = list(out.rglob("profile_export_aiperf.json"))
    if not found:
        raise SystemExit(f"aiperf wrote no profile_export_aiperf.json under {out}:\n{p.stdout[-3000:]}")
    return json.loads(found[0].read_text())


def summarize(export: dict) -> dict:
    res = {}
    for name, label in METRICS.items():
        m = export.get(name) or export.get("records", {}).get(name)
        if not m:
            continue
        res[name] = {k: round(v, 3) for k, v in m.items() if k in ("avg", "p50", "p90", "p99") and v is not None}
        res[name]["unit"] = m.get("unit")
    for name in ("request_count", "error_request_count", "cancelled_request_count", "was_cancelled_count"):
        m = export.get(name)
        if isinstance(m, dict) and "avg" in m:
            res[name] = m["avg"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--url", default=None, help="a running stack (default: start the README's stack here)")
    ap.add_argument("--requests", type=int, default=0, help="default 40 quick / 120 full")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--cancel-pct", type=float, default=20.0)
    ap.add_argument("--image-px", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=32)
    _results.add_mode_args(ap)
    args = ap.parse_args()
    if args.smoke:
        args.requests, args.output_tokens = 4, 4
        if not AIPERF.exists():  # CI does not install aiperf: say so rather than pass unseen
            cmd = aiperf_command("http://127.0.0.1:1", "m", "t", Path(tempfile.gettempdir()), requests=4,
                                 concurrency=args.concurrency, cancel_pct=args.cancel_pct, image_px=args.image_px,
                                 output_tokens=args.output_tokens)
            _results.record("aiperf_chat", ap, args, {"aiperf": None, "command": cmd}, kind="wall-clock",
                            baseline="none: ours only, measured by NVIDIA aiperf", summary="aiperf not installed",
                            skipped=[f"the whole run: {AIPERF} is missing (bash scripts/load_clients.sh aiperf)"])
            return
    if not AIPERF.exists():
        raise SystemExit(f"{AIPERF} is missing: run `bash scripts/load_clients.sh aiperf` first")
    from mmserve.cli import ensure_default_model
    from mmserve.launcher import LocalStack, StackSpec

    model_dir = ensure_default_model(None)
    model = Path(model_dir).name
    requests = args.requests or (40 if args.quick else 120)
    out = Path(tempfile.mkdtemp(prefix="mmserve-aiperf-"))
    kw = dict(requests=requests, concurrency=args.concurrency, cancel_pct=args.cancel_pct,
              image_px=args.image_px, output_tokens=args.output_tokens)
    if args.url:
        cmd = aiperf_command(args.url, model, model_dir, out, **kw)
        print(" ".join(cmd), flush=True)
        export = run_aiperf(cmd, out)
    else:
        with LocalStack(StackSpec(model_dir=model_dir, gateway_port=0)) as stack:
            stack.wait_ready(timeout=300)
            cmd = aiperf_command(stack.url, model, model_dir, out, **kw)
            print(" ".join(cmd), flush=True)
            export = run_aiperf(cmd, out)
    res = summarize(export)
    print(f"\naiperf: {requests} streamed chat requests with one {args.image_px}x{args.image_px} PNG each, "
          f"concurrency {args.concurrency}, {args.cancel_pct:g}% cancelled by the client after 0.2 s, "
          f"{args.output_tokens} output tokens (ignore_eos); artifacts {out}")
    for name, label in METRICS.items():
        if name in res:
            r = res[name]
            print(f"  {label:22s} " + "  ".join(f"{k} {v}" for k, v in r.items() if k != "unit") + f"  {r['unit']}")
    figures = {"quick": args.quick, "requests": requests, "concurrency": args.concurrency, "cancel_pct": args.cancel_pct,
               "image_px": args.image_px, "output_tokens": args.output_tokens, "aiperf": res}

    def p(name: str, k: str) -> str:
        return str(res.get(name, {}).get(k, "-"))

    _results.record("aiperf_chat", ap, args, figures, kind="wall-clock", baseline="none: ours only, measured by NVIDIA aiperf",
                    summary=f"TTFT p50 {p('time_to_first_token', 'p50')} ms (p90 {p('time_to_first_token', 'p90')}), "
                            f"ITL p50 {p('inter_token_latency', 'p50')} ms, {p('output_token_throughput', 'avg')} output tok/s, "
                            f"{p('request_throughput', 'avg')} req/s; {requests} requests, {args.cancel_pct:g}% cancelled")


if __name__ == "__main__":
    _results.run(main)
