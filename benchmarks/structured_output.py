"""Structured output, served: our stack (gateway + one ``swa`` LLM service) against vLLM 0.32's
OpenAI server on the CPU, the same checkpoint, the same KV budget, the same requests, wall-clock.

Checkpoint: the MiMo benchmark weights (``ensure_checkpoint(MiMoSpec())``, our seed architecture)
with a JSON-capable 4096-token tokenizer (``benchmarks.grammar_engines.json_checkpoint``: the
stock benchmark tokenizer has no '{', '"' or digit, so no JSON document can be written with it).

1. Slowdown: 16 concurrent streamed chats (random pseudo-word prompts of 16-64 tokens,
   max_tokens 64, temperature 0), once unconstrained (``ignore_eos``, as ``benchmarks.vs_vllm``)
   and once with ``response_format`` = ``json_schema`` (``SCHEMA``: exactly 8 bounded objects,
   whose shortest document is longer than 64 tokens, so every answer runs to max_tokens on both
   sides). Whitespace: each side's default (both allow it: vLLM's ``disable_any_whitespace``
   False, our ``any_whitespace`` True). Per side and mode: output tok/s (completion tokens /
   wall), TTFT p50; slowdown = unconstrained tok/s / constrained tok/s. Sides A-B-B-A per
   round; a warm-up per side and mode first (the schema is then compiled and cached on both).
2. Compile stall: 8 unconstrained streams (max_tokens ``STALL_TOKENS``); ``STALL_AT`` s after
   they start, a 9th request (16 tokens out) is sent: with a fresh ``wide_schema(200, seed)`` (a
   new seed every run, so no cache helps), or the same request unconstrained. p99 inter-token
   gap of the 8 streams over the ``STALL_WINDOW`` s after that moment; ratio with / without per
   side (with-without order alternating per side and round). Both modes admit the same 9th
   request (its prefill and decodes join the batch either way), so the ratio is what the
   schema's compile and masks cost the other users; until 2026-12-03 the "without" mode sent
   no 9th request at all, which charged that request's own prefill to the compile.

Targets (the issue): ours slowdown <= 1.1 and <= vLLM's; our stall ratio <= 1.2. The LAST line
is one JSON object with every figure, the targets and ``met`` flags. Runs hold the benchmark
lock (``benchmarks._bench_host.bench_lock``) and wait for a quiet machine before each run; a
run with more than 0.3 foreign cores is flagged ``disturbed``.

    python -m benchmarks.structured_output [--quick] [--rounds R] [--kv-gib G] [--seed S]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import openai

from benchmarks import _results
from benchmarks import _vs_vllm_servers as srv
from benchmarks._bench_host import CpuMeter, bench_lock, wait_quiet
from benchmarks._chat_load import PromptMaker, drive, openai_client
from benchmarks._stats import percentile, scaled
from benchmarks._vs_vllm_runs import DISTURBED, SIDES, Group, resolve_preload
from benchmarks.grammar_engines import json_checkpoint
from mmserve.tiny.schemas import wide_schema

SCHEMA = {"type": "array", "minItems": 8, "maxItems": 8, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "name", "ok", "score"],
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                   "name": {"type": "string", "minLength": 3, "maxLength": 8},
                   "ok": {"type": "boolean"}, "score": {"type": "number", "minimum": 0, "maximum": 10}}}}
CONCURRENCY, MAX_TOKENS = 16, 64
STALL_STREAMS, STALL_TOKENS, STALL_AT, STALL_WINDOW = 8, 160, 1.0, 3.0
TARGETS = {"ours_slowdown_max": 1.1, "ours_slowdown_vs_vllm": "<=", "ours_stall_ratio_max": 1.2}


async def stream(client, model: str, prompt: str, max_tokens: int, schema: dict | None) -> dict:
    """One streamed chat; chunk arrival times (absolute perf_counter) and usage."""
    extra = {} if schema else {"ignore_eos": True}
    kw = {"response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": schema,
                                                                      "strict": True}}} if schema else {}
    t0 = time.perf_counter()
    rec = {"t0": t0, "times": [], "tokens": 0, "error": None, "text": []}
    try:
        s = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body=extra, **kw)  # fmt: skip
        async for chunk in s:
            if chunk.usage is not None:
                rec["tokens"] = chunk.usage.completion_tokens
            for c in chunk.choices:
                if c.delta.content:
                    rec["times"].append(time.perf_counter())
                    rec["text"].append(c.delta.content)
    except openai.APIError as e:
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
    rec["t1"] = time.perf_counter()
    rec["text"] = "".join(rec["text"])
    return rec


def client_for(url: str):
    return openai_client(url, timeout=600)


async def batch(url: str, model: str, prompts: list[str], schema: dict | None) -> tuple[list[dict], float]:
    """Every prompt at once (``benchmarks._chat_load.drive``): records in prompt order, wall time."""
    client = client_for(url)
    try:
        return await drive(len(prompts), lambda i: stream(client, model, prompts[i], MAX_TOKENS, schema))
    finally:
        await client.close()


async def stall_run(url: str, model: str, prompts: list[str], wide: dict | None) -> dict:
    """8 unconstrained streams; ``STALL_AT`` s in, a 9th request under ``wide`` (None: unconstrained)
    (``benchmarks._chat_load.drive`` with those arrival times)."""
    client = client_for(url)
    sent: list[float] = []

    async def one(i: int) -> dict:
        if i < STALL_STREAMS:
            return await stream(client, model, prompts[i], STALL_TOKENS, None)
        sent.append(time.perf_counter())
        return await stream(client, model, prompts[-1], 16, wide)

    try:
        out, wall = await drive(STALL_STREAMS + 1, one, arrivals=[0.0] * STALL_STREAMS + [STALL_AT])
    finally:
        await client.close()
    recs, w, t_send = out[:STALL_STREAMS], out[STALL_STREAMS], sent[0]
    gaps = [b - a for r in recs for a, b in zip(r["times"], r["times"][1:]) if t_send <= b <= t_send + STALL_WINDOW]
    return {"itl_p99_ms": scaled(percentile(gaps, 99), 1000), "itl_p50_ms": scaled(percentile(gaps, 50), 1000),
            "gaps": len(gaps), "errors": sum(r["error"] is not None for r in recs),
            "streams_done_before_window_end": sum(r["t1"] < t_send + STALL_WINDOW for r in recs),
            "wide": None if w is None else {"e2e_s": round(w["t1"] - w["t0"], 2), "error": w["error"],
                                            "ttft_s": round(w["times"][0] - w["t0"], 2) if w["times"] else None},
            "wall_s": round(wall, 2)}  # fmt: skip


def batch_stats(recs: list[dict], wall: float) -> dict:
    ok = [r for r in recs if r["error"] is None]
    toks = sum(r["tokens"] for r in ok)
    ttft = [r["times"][0] - r["t0"] for r in ok if r["times"]]
    valid = 0
    for r in ok:
        with contextlib.suppress(ValueError):
            json.loads(r["text"])
            valid += 1
    return {"output_tok_s": round(toks / wall, 2), "ttft_p50_ms": scaled(percentile(ttft, 50), 1000),
            "wall_s": round(wall, 2), "completion_tokens": toks, "errors": len(recs) - len(ok),
            "first_error": next((r["error"] for r in recs if r["error"]), None),
            "short_outputs": sum(r["tokens"] < MAX_TOKENS for r in ok), "complete_json_docs": valid}  # fmt: skip


def timed(args, meter: CpuMeter, fn) -> dict:
    quiet = wait_quiet(meter, args.max_foreign, args.quiet_timeout)
    meter.start()
    st = fn()
    st["cpu_cores"] = meter.stop()
    st["foreign_cores_before"] = quiet
    st["disturbed"] = st["cpu_cores"]["foreign"] > DISTURBED
    return st


def mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(sum(xs) / len(xs), 2) if xs else None


def run(args, g: Group, maker: PromptMaker) -> dict:
    rng = random.Random(args.seed)
    prompts = lambda n: [maker.text(rng, rng.randint(16, 64))[0] for _ in range(n)]  # noqa: E731
    sides = g.sides
    for side in sides:  # warm-up: both modes, so the schema is compiled and cached on each side
        for schema in (None, SCHEMA):
            recs, _ = asyncio.run(batch(g.url[side], g.served, prompts(4), schema))
            if any(r["error"] for r in recs):
                raise RuntimeError(f"{side} warm-up failed: {next(r['error'] for r in recs if r['error'])}")
    meter = CpuMeter(g.roots())
    runs = {m: {s: [] for s in sides} for m in ("unconstrained", "json_schema")}
    stall = {m: {s: [] for s in sides} for m in ("without", "with")}
    for k in range(args.rounds):
        for mode, schema in (("unconstrained", None), ("json_schema", SCHEMA)):
            p = prompts(CONCURRENCY)  # identical requests for every side of this round
            order = (*sides, *sides[::-1]) if k % 2 == 0 else (*sides[::-1], *sides)
            for side in order if len(sides) > 1 else sides:  # A-B-B-A; one side alone runs once
                st = timed(args, meter, lambda: batch_stats(*asyncio.run(batch(g.url[side], g.served, p, schema))))
                runs[mode][side].append(st)
                print(f"round {k} {mode:13s} {side:4s}: {st['output_tok_s']:7.1f} tok/s  TTFT p50 "
                      f"{st['ttft_p50_ms']:7.1f} ms  wall {st['wall_s']:5.2f} s  errors {st['errors']}  short "
                      f"{st['short_outputs']}  json docs {st['complete_json_docs']}  cores {st['cpu_cores']}"
                      f"{'  DISTURBED' if st['disturbed'] else ''}", flush=True)  # fmt: skip
        for side in sides if k % 2 == 0 else sides[::-1]:
            for i, mode in enumerate(("without", "with") if k % 2 == 0 else ("with", "without")):
                p = prompts(STALL_STREAMS + 1)
                wide = wide_schema(200, seed=1000 + 10 * k + i + (0 if side == "ours" else 500)) \
                    if mode == "with" else None  # fmt: skip
                st = timed(args, meter, lambda: asyncio.run(stall_run(g.url[side], g.served, p, wide)))
                stall[mode][side].append(st)
                print(f"round {k} stall {mode:7s} {side:4s}: ITL p99 {st['itl_p99_ms']:6.1f} ms  p50 "
                      f"{st['itl_p50_ms']:5.1f} ms  gaps {st['gaps']}  wide {st['wide']}  cores {st['cpu_cores']}"
                      f"{'  DISTURBED' if st['disturbed'] else ''}", flush=True)  # fmt: skip
    return summarize(runs, stall, sides)


def summarize(runs: dict, stall: dict, sides: tuple[str, ...] = SIDES) -> dict:
    out = {"per_side": {}, "runs": runs, "stall_runs": stall}
    for side in sides:
        u, j = runs["unconstrained"][side], runs["json_schema"][side]
        tu, tj = mean([r["output_tok_s"] for r in u]), mean([r["output_tok_s"] for r in j])
        sw, so = mean([r["itl_p99_ms"] for r in stall["with"][side]]), mean([r["itl_p99_ms"] for r in stall["without"][side]])
        out["per_side"][side] = {
            "unconstrained_tok_s": tu, "json_schema_tok_s": tj,
            "unconstrained_ttft_p50_ms": mean([r["ttft_p50_ms"] for r in u]),
            "json_schema_ttft_p50_ms": mean([r["ttft_p50_ms"] for r in j]),
            "slowdown": round(tu / tj, 3) if tu and tj else None,
            "stall_itl_p99_ms_with_wide": sw, "stall_itl_p99_ms_without": so,
            "stall_ratio": round(sw / so, 3) if sw and so else None,
            "wide_request_e2e_s": mean([r["wide"]["e2e_s"] for r in stall["with"][side] if r["wide"]]),
            "errors": sum(r["errors"] for r in u + j), "short_outputs": sum(r["short_outputs"] for r in u + j),
            "disturbed_runs": sum(r["disturbed"] for r in u + j + stall["with"][side] + stall["without"][side]),
        }  # fmt: skip
    o, v = out["per_side"]["ours"], out["per_side"].get("vllm", {"slowdown": None})
    met = lambda c: None if c is None else bool(c)  # noqa: E731
    out["targets"] = {
        **TARGETS,
        "ours_slowdown_le_1.1": met(o["slowdown"] and o["slowdown"] <= 1.1),
        "ours_slowdown_le_vllm": met(o["slowdown"] and v["slowdown"] and o["slowdown"] <= v["slowdown"]),
        "ours_stall_ratio_le_1.2": met(o["stall_ratio"] and o["stall_ratio"] <= 1.2),
    }
    out["targets"]["summary"] = {k: ("met" if x else "not met") for k, x in out["targets"].items()
                                 if k.startswith("ours_") and isinstance(x, bool)}
    return out


def report(s: dict) -> None:
    print(f"\n{'side':5s} {'free tok/s':>10s} {'json tok/s':>10s} {'slowdown':>8s} {'TTFT free':>10s} "
          f"{'TTFT json':>10s} {'ITL p99 w/o':>11s} {'with wide':>10s} {'stall x':>8s} {'wide e2e':>9s}")
    for side, x in s["per_side"].items():
        print(f"{side:5s} {x['unconstrained_tok_s']:10.1f} {x['json_schema_tok_s']:10.1f} {x['slowdown']:8.3f} "
              f"{x['unconstrained_ttft_p50_ms']:8.1f}ms {x['json_schema_ttft_p50_ms']:8.1f}ms "
              f"{x['stall_itl_p99_ms_without']:9.1f}ms {x['stall_itl_p99_ms_with_wide']:8.1f}ms "
              f"{x['stall_ratio']:8.3f} {x['wide_request_e2e_s']:7.2f}s")  # fmt: skip
    print("targets: " + ", ".join(f"{k}: {v}" for k, v in s["targets"]["summary"].items()), flush=True)


def _sigterm(*_):
    raise KeyboardInterrupt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one round")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (A-B-B-A each; 3, 1 --quick)")
    ap.add_argument("--kv-gib", type=float, default=float(srv.KV_GIB), help="KV budget of both sides")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lock-timeout", type=float, default=3600.0)
    ap.add_argument("--max-foreign", type=float, default=0.25)
    ap.add_argument("--quiet-timeout", type=float, default=None, help="s to wait for a quiet machine per run")
    _results.add_mode_args(ap)
    args = ap.parse_args()
    # a smoke run is ours alone, one round, no wait for a quiet machine: vLLM's start-up takes minutes here
    sides = ("ours",) if args.smoke else SIDES
    skipped = ["the vLLM side (its start-up takes minutes on 2 cores): ours only, one round"] if args.smoke else []
    if args.smoke:
        args.rounds, args.quiet_timeout = 1, 0.0
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.quiet_timeout = args.quiet_timeout if args.quiet_timeout is not None else (20.0 if args.quick else 120.0)
    if "vllm" in sides and not srv.vllm_available():
        print(f"no vLLM venv at {srv.VLLM_VENV}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _sigterm)  # `kill` stops the servers too
    from transformers import AutoTokenizer

    t_begin = time.perf_counter()
    model_dir = json_checkpoint()
    log_dir = tempfile.mkdtemp(prefix="mmserve-structured-")
    cfgs = {"vllm": {"bind": "auto", "ld_preload": resolve_preload("auto"), "eager": False},
            "ours": {"threads": None, "batch_tokens": None, "ld_preload": "", "host_kv": "default"}}
    kv = int(args.kv_gib * 2**30)
    result = {"kind": "structured_output", "benchmark": "structured_output", "quick": args.quick, "wall_clock": True,
              "model_dir": str(model_dir), "kv_bytes_both": kv, "rounds": args.rounds, "schema": SCHEMA,
              "whitespace": "each side's default: whitespace allowed on both (vLLM disable_any_whitespace=False)",
              "workload": {"concurrency": CONCURRENCY, "max_tokens": MAX_TOKENS, "prompt_tokens": [16, 64],
                           "stall_streams": STALL_STREAMS, "stall_max_tokens": STALL_TOKENS, "stall_at_s": STALL_AT,
                           "stall_window_s": STALL_WINDOW, "wide_schema": "wide_schema(200, fresh seed per run)"}}
    try:
        with bench_lock(args.lock_timeout) as locked, contextlib.ExitStack() as stack:
            result["bench_lock_held"] = locked
            maker = PromptMaker(AutoTokenizer.from_pretrained(model_dir), srv.word_list())
            g = Group(args, "mimo", "structured", model_dir, srv.MAX_MODEL_LEN, kv, cfgs, Path(log_dir), sides=sides)
            g.start(stack)
            result["startup_s"] = g.startup
            result.update(run(args, g, maker))
    except KeyboardInterrupt:
        print("interrupted: servers stopped", file=sys.stderr)
        return 130
    except Exception as e:
        print(f"FAILED: {type(e).__name__}: {e}\nlogs: {log_dir}", file=sys.stderr)
        return 1
    report(result)
    shutil.rmtree(log_dir, ignore_errors=True)
    result["total_s"] = round(time.perf_counter() - t_begin, 1)
    o, v = result["per_side"]["ours"], result["per_side"].get("vllm", {})
    t = result["targets"]["summary"]
    _results.record("structured_output", ap, args, result, kind="wall-clock", skipped=skipped,
                    baseline="vLLM 0.32; the same 9th request unconstrained (stall baseline)",
                    summary=f"slowdown {o['slowdown']}x (vLLM {v.get('slowdown')}x), <= 1.1x "
                            f"{t.get('ours_slowdown_le_1.1', 'n/a')}; compile stall {o['stall_ratio']}x "
                            f"(vLLM {v.get('stall_ratio')}x), <= 1.2x {t.get('ours_stall_ratio_le_1.2', 'n/a')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
