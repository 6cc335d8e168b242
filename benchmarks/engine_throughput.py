"""Output tokens/s of the swa engine vs transformers ``generate`` (one at a time, and batched).

Workload: the tiny MiMo bundle (7 layers, W=128, MoE, sinks), ``--requests`` concurrent
requests (default 32) with random-token prompts of 64..256 tokens and ``--max-tokens`` output
tokens each (eos ignored, so every side produces the same number of tokens). Greedy decoding:
the engine's tokens are also checked against the one-at-a-time reference.

    python -m benchmarks.engine_throughput [--quick]

The last line of output is a JSON object with all numbers.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import _results
from llm_svc.types.request import GenOutput, RequestStream
from llm_svc.loading.loader import load_lm
from llm_svc.types.request import PreparedRequest
from shared.schemas import SamplingParams
from shared.settings import LLMSettings


class _Collect(RequestStream):
    def __init__(self, rid: str):
        self.request_id, self.outs = rid, []

    def put(self, out: GenOutput) -> None:
        self.outs.append(out)


def make_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(20, vocab) for _ in range(rng.randint(64, 256))] for _ in range(n)]


def run_engine(lm, prompts, max_tokens: int) -> tuple[float, list[list[int]], int]:
    from llm_svc.core.build import build_engine
    from mmserve.testing.in_process import InProcessEngine

    settings = LLMSettings(model_dir=str(lm.spec.root), backend="swa", kv_bytes=64 * 1024 * 1024,
                           max_batch_tokens=512, max_running=len(prompts))
    engine = InProcessEngine(build_engine(settings, lm), lm.tokenizer)
    # warm-up: one short request (first-call overheads are not throughput)
    warm = _Collect("warm")
    engine.submit(PreparedRequest("warm", prompts[0][:16], SamplingParams(max_tokens=2)), warm)
    while not (warm.outs and warm.outs[-1].final):
        engine.step()
    streams = [_Collect(f"r{i}") for i in range(len(prompts))]
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.submit(PreparedRequest(f"r{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)), streams[i])
    steps = 0
    while not all(s.outs and s.outs[-1].final for s in streams):
        engine.step()
        steps += 1
    dt = time.perf_counter() - t0
    engine.scheduler.check_integrity()
    return dt, [[t for o in s.outs for t in o.token_ids] for s in streams], steps


@torch.inference_mode()
def run_hf_serial(lm, prompts, max_tokens: int) -> tuple[float, list[list[int]]]:
    m = lm.model
    m.generate(torch.tensor([prompts[0][:16]]), max_new_tokens=2, do_sample=False)  # warm-up
    outs = []
    t0 = time.perf_counter()
    for p in prompts:
        ids = torch.tensor([p])
        o = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                       do_sample=False, eos_token_id=[], pad_token_id=0)
        outs.append(o[0, len(p):].tolist())
    return time.perf_counter() - t0, outs


@torch.inference_mode()
def run_hf_batched(lm, prompts, max_tokens: int) -> float:
    m = lm.model
    n = max(len(p) for p in prompts)
    pad = lm.tokenizer.pad_token_id or 0
    ids = torch.tensor([[pad] * (n - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    m.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
               eos_token_id=[], pad_token_id=pad)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer output tokens (about a minute)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: stable numbers)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per side; the best counts")
    ap.add_argument("--serial-stride", type=int, default=None,
                    help="time one-at-a-time generate on every k-th request (default 2, --quick 4)")
    ap.add_argument("--model-dir", default=None, help="a bundle; default: write the tiny MiMo one")
    _results.add_mode_args(ap)
    args = ap.parse_args()
    if args.smoke:
        args.requests, args.repeats, args.max_tokens, args.serial_stride = 4, 1, 3, 2
    torch.set_num_threads(args.threads)
    max_tokens = args.max_tokens or (24 if args.quick else 64)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            from mmserve.tiny_model import write_tiny_model

            model_dir = str(write_tiny_model(Path(tmp) / "tiny-mimo"))
        lm = load_lm(model_dir)
        prompts = make_prompts(args.requests, lm.vocab_size)
        total = args.requests * max_tokens
        print(f"workload: {args.requests} requests, prompts {min(map(len, prompts))}..{max(map(len, prompts))} "
              f"tokens, {max_tokens} output tokens each ({total} total), model {lm.spec.lm_architecture}")

        stride = args.serial_stride or (4 if args.quick else 2)
        subset = list(range(0, len(prompts), stride))
        best = {"ours": float("inf"), "serial": float("inf"), "batched": float("inf")}
        for rep in range(args.repeats):
            t, ours, steps = run_engine(lm, prompts, max_tokens)
            best["ours"] = min(best["ours"], t)
            t, ref = run_hf_serial(lm, [prompts[i] for i in subset], max_tokens)
            best["serial"] = min(best["serial"], t)
            best["batched"] = min(best["batched"], run_hf_batched(lm, prompts, max_tokens))
            print(f"  run {rep + 1}: ours {best['ours']:.2f}s  serial({len(subset)} req) {best['serial']:.2f}s  "
                  f"batched {best['batched']:.2f}s (best so far)")
        ours_tps = total / best["ours"]
        serial_tps = len(subset) * max_tokens / best["serial"]
        batched_tps = total / best["batched"]
        print(f"ours (swa engine, continuous batching): {ours_tps:8.1f} tok/s  ({steps} steps)")
        print(f"transformers generate, one at a time:   {serial_tps:8.1f} tok/s  (on {len(subset)} of the requests)")
        print(f"transformers generate, one batch of {args.requests}: {batched_tps:8.1f} tok/s")
        match = sum(ours[i] == r for i, r in zip(subset, ref))
        print(f"greedy outputs identical to one-at-a-time generate: {match}/{len(subset)}")
        result = {
            "benchmark": "engine_throughput",
            "requests": args.requests,
            "max_tokens": max_tokens,
            "ours_tok_s": round(ours_tps, 1),
            "hf_serial_tok_s": round(serial_tps, 1),
            "hf_batched_tok_s": round(batched_tps, 1),
            "speedup_vs_serial": round(ours_tps / serial_tps, 2),
            "speedup_vs_batched": round(ours_tps / batched_tps, 2),
            "outputs_match": f"{match}/{len(subset)}",
            "target_speedup_vs_serial": 5.0,
        }
        print(f"speedup vs one at a time: {result['speedup_vs_serial']}x (target >= 5x); "
              f"vs batched generate: {result['speedup_vs_batched']}x")
        _results.record("engine_throughput", ap, args, result, kind="wall-clock",
                        baseline="transformers generate, one at a time and one batch",
                        summary=f"{result['speedup_vs_serial']}x one-at-a-time, {result['speedup_vs_batched']}x batched "
                                f"({args.requests} requests x {max_tokens} tokens)")


if __name__ == "__main__":
    _results.run(main)
