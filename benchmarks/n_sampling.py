"""``n`` = 4 against 4 separate requests with the same prompt, ours and vLLM's, side by side:
prompt tokens computed (the prompt's tokens minus the prefix-cache hits, from each server's own
counters) and wall time. Target (issue 19): ours computes the prompt once, 1x, not 4x.

Both servers serve the MiMo-form benchmark checkpoint (``benchmarks._vs_vllm_servers``) with
the same KV budget; ours behind its gateway, vLLM direct. Each run sends a fresh random prompt
(about ``--words`` words) so that no run hits an earlier run's cache; the four separate requests
are sent at once. Sides alternate A-B-B-A per round. Wall-clock, not a simulation.

    python -m benchmarks.n_sampling --quick
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import _vs_vllm_servers as srv
from benchmarks import _results
from benchmarks._bench_host import bench_lock
from benchmarks._chat_load import drive, openai_client

N = 4


def parse_args() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one round (about two minutes with start-up)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--words", type=int, default=600, help="prompt length in words (~2 tokens each)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--lock-timeout", type=float, default=1800)
    _results.add_mode_args(p)
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.words, args.max_tokens = 1, 40, 4
    return p, args


def _prompt(rng: random.Random, words: list[str], n: int) -> list[dict]:
    return [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(n))}]


def _computed(side: str, before: dict, after: dict) -> float:
    hits, queries = srv.PREFIX_METRICS[side]
    return (after.get(queries, 0) - before.get(queries, 0)) - (after.get(hits, 0) - before.get(hits, 0))


async def _run(url: str, model: str, messages: list[dict], mode: str, max_tokens: int) -> tuple[float, int]:
    """(wall time, prompt tokens of the first answer): one request with ``n`` = N, or N separate
    requests at once (``benchmarks._chat_load.drive``), not streamed."""
    client = openai_client(url, timeout=600)

    async def one(i: int):
        extra = {"n": N, "seed": 1} if mode == "n" else {"seed": 1 + i}
        return await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                    temperature=1.0, extra_body={"ignore_eos": True}, **extra)

    try:
        out, wall = await drive(1 if mode == "n" else N, one)
    finally:
        await client.close()
    return wall, out[0].usage.prompt_tokens


def measure(side: str, url: str, metrics_url: str, model: str, messages: list[dict], mode: str,
            max_tokens: int) -> dict:
    before = srv.scrape(metrics_url)
    wall, prompt = asyncio.run(_run(url, model, messages, mode, max_tokens))
    time.sleep(0.5)  # counters of finished requests
    computed = _computed(side, before, srv.scrape(metrics_url))
    return {"wall_s": round(wall, 3), "prompt_tokens": prompt, "computed_prompt_tokens": computed,
            "prompt_passes": round(computed / prompt, 2) if prompt else None}


def main() -> int:
    ap, args = parse_args()
    # a smoke run is ours alone: vLLM's start-up takes minutes on 2 cores
    sides = ("ours",) if args.smoke else ("ours", "vllm")
    skipped = ["the vLLM side (its start-up takes minutes on 2 cores): ours only"] if args.smoke else []
    if "vllm" in sides and not srv.vllm_available():
        print(f"no vLLM venv at {srv.VLLM_VENV}", file=sys.stderr)
        return 2
    rounds = 1 if args.quick else args.rounds
    model_dir = srv.ensure_checkpoint(srv.MiMoSpec())
    served = "mimo-bench"
    log_dir = Path(tempfile.mkdtemp(prefix="mmserve-n-sampling-"))
    words = srv.word_list()
    rng = random.Random(0)
    runs: dict[str, dict[str, list[dict]]] = {s: {"n": [], "separate": []} for s in sides}
    with bench_lock(args.lock_timeout), contextlib.ExitStack() as stack:
        ends = {}
        if "vllm" in sides:
            vllm = srv.vllm_service(model_dir, log_dir, served=served)
            srv.start_vllm(vllm, 600)
            stack.callback(vllm.stop)
            ends["vllm"] = (vllm.url, vllm.url)
        ours = srv.our_services(model_dir, log_dir, served=served)
        srv.start_ours(ours, 600)
        stack.callback(lambda: [s.stop() for s in ours])
        ends["ours"] = (ours[1].url, ours[0].url)
        for side in sides:  # warm both (first-request compiles, allocator)
            measure(side, *ends[side], served, _prompt(rng, words, 50), "n", 4)
        for r in range(rounds):
            order = ("ours", "vllm", "vllm", "ours") if r % 2 == 0 else ("vllm", "ours", "ours", "vllm")
            for k, side in enumerate(x for x in order if x in sides):
                for mode in (("n", "separate") if k % 2 == 0 else ("separate", "n")):
                    res = measure(side, *ends[side], served, _prompt(rng, words, args.words), mode, args.max_tokens)
                    runs[side][mode].append(res)
                    print(f"round {r} {side:5s} {mode:8s} {res}", flush=True)
    summary = {}
    for side, modes in runs.items():
        summary[side] = {mode: {"wall_s_median": statistics.median(x["wall_s"] for x in rs),
                                "prompt_passes_median": statistics.median(x["prompt_passes"] for x in rs)}
                         for mode, rs in modes.items()}
    ours_passes = summary["ours"]["n"]["prompt_passes_median"]
    vllm_passes = summary.get("vllm", {}).get("n", {}).get("prompt_passes_median")
    print(f"\nprompt passes for n={N}: ours {ours_passes} (target 1.0), vLLM {vllm_passes}")
    for side in sides:
        s = summary[side]
        print(f"{side}: wall n={N} {s['n']['wall_s_median']:.2f} s, {N} separate {s['separate']['wall_s_median']:.2f} s")
    met = ours_passes is not None and ours_passes <= 1.05
    figures = {"quick": args.quick, "n": N, "words": args.words, "max_tokens": args.max_tokens, "summary": summary,
               "runs": runs, "target": {"ours_n_prompt_passes": 1.0, "met": met}}
    _results.record("n_sampling", ap, args, figures, kind="wall-clock", baseline=f"vLLM 0.32; {N} separate requests",
                    skipped=skipped, summary=f"{ours_passes:.2f}x the prompt (vLLM {vllm_passes}x), target 1x "
                                             f"{'**met**' if met else '**not met**'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
