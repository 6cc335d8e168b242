"""Our stack (gateway + one ``swa`` LLM service) against vLLM 0.32 on the CPU: one checkpoint,
one client, one trace, through each one's OpenAI ``/v1/chat/completions`` (streaming).

Model: a random-weight text-only ``Gemma3ForCausalLM`` in the plain HF layout (hidden 512,
12 layers = 2 x (5 sliding + 1 full), window 512, 8 q / 4 kv heads of 64, vocab 4096, ~40 M
parameters; ``benchmarks._vs_vllm_servers``), written once to ``~/.cache/mmserve/bench/`` and
loaded by both servers from that directory. Both run float32 with a 2 GiB KV budget
(``VLLM_CPU_KVCACHE_SPACE=2``, our ``--kv-bytes 2 GiB``), max model length 4096, each with its
own default batching knobs (vLLM on CPU: 2048 batched tokens per step, 128 sequences; ours:
512 and 64). vLLM runs from ``~/.cache/mmserve/vllm-venv`` (see shared ENV.md) with
torch.compile. Compute threads are equal by default: vLLM's auto binding runs one OpenMP
thread per worker and keeps the other core(s) for its scheduler; our LLM service gets
``OMP_NUM_THREADS = cores - 1`` (``--ours-threads 0`` leaves torch's default, every core; its
OpenMP threads then wait on each other in barriers whenever the gateway, the client or
anything else takes a core, and throughput drops by up to 5x on this machine).

Trace (seeded): ``--requests`` (48; 12 with --quick) chat requests whose user message is random
pseudo-words, 128-2048 prompt tokens (128-512 with --quick), each asking for 64-256 output
tokens (16-32 with --quick) with ``ignore_eos`` and ``max_tokens``, temperature 0. The
checkpoint's special tokens have zero embeddings, so greedy decoding never emits EOS and both
sides produce exactly ``max_tokens`` tokens (our gateway does not forward ``ignore_eos``; the
usage chunk's ``completion_tokens`` is checked). Two load modes:

* ``concurrency``: ``--concurrency`` (16; 4 with --quick) requests in flight at all times;
* ``rate``: Poisson arrivals (seeded) at ``--rate`` req/s (default: 0.7 x the slower side's
  req/s in the concurrency mode), no cap on requests in flight.

Each mode runs ``--pairs`` (2; 1 with --quick) pairs in the order A-B, B-A, ... (vLLM first in
even pairs, ours first in odd ones). Every pair gets fresh prompts (no prefix-cache hit from an
earlier run); both sides of a pair get the same prompts. Both servers stay up the whole time
(their idle CPU use is measured and printed); one warm-up request batch per side comes first.

Reported per side and mode: output tok/s (completion tokens / wall time of the run), TTFT
p50/p90 (request sent -> first non-empty content chunk), ITL p50 (gap between content chunks)
and TPOT p50 (per request (e2e - TTFT) / (tokens - 1)), and per pair how many greedy outputs
are identical between the sides. The last line is one JSON object with every number and the
ratios ours / vLLM.

Runs hold ``/tmp/mmserve-bench.lock`` (flock) from server start to the end, so two benchmarks
never share this 2-core machine; before each run the benchmark waits (up to
``--quiet-timeout``) until other work on the machine (a test suite) uses at most
``--max-foreign`` cores, and every run records the cores used by each server, the client and
everything else (``foreign``; a run with more than 0.3 foreign cores is flagged DISTURBED).
``--profile DIR`` adds one extra (unmeasured) concurrency run per side under
``py-spy record --subprocesses --threads --idle`` and prints, per busy thread, where the time goes.

Cost on the 2-core dev box: ``--quick`` about 3-4 min (vLLM start-up ~50 s with a warm
``~/.cache/vllm`` compile cache, ~2 min cold; ours ~15 s; the runs ~1.5 min); the full run
about 31 min (4 concurrency runs of 2-3 min, 4 rate runs of ~4.5 min), 36 min with --profile.

    python -m benchmarks.vs_vllm [--quick] [--requests N] [--concurrency C] [--rate R] [--pairs P]
                                 [--seed S] [--profile DIR] [--ours-threads N] [--ours-batch-tokens N]
                                 [--vllm-bind auto|0-1] [--vllm-eager] [--keep-logs]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import _vs_vllm_servers as srv
from benchmarks._bench_host import CpuMeter, bench_lock, idle_cpu, wait_quiet
from benchmarks._chat_load import (
    PromptMaker, agreement, make_trace, poisson_arrivals, run_load, run_stats, side_summary,
)  # fmt: skip
from benchmarks._pyspy_summary import format_summary, record, summarize

SIDES = ("vllm", "ours")
DISTURBED = 0.3  # foreign cores during a run above which its numbers are flagged


def rate_from(conc_runs: dict[str, list[dict]]) -> float:
    """0.7 x the slower side's req/s at fixed concurrency (undisturbed runs when there are some),
    so the rate mode measures latency at a load both sides sustain."""
    def req_s(rs: list[dict]) -> float:
        calm = [r for r in rs if not r["disturbed"]] or rs
        return side_summary(calm)["req_s"]

    return round(0.7 * min(req_s(conc_runs[s]) for s in SIDES), 4)


def _sigterm(*_):
    raise KeyboardInterrupt


# ---- main --------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="12 short requests, 1 pair per mode")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=None)
    ap.add_argument("--rate", type=float, default=None, help="req/s of the rate mode (default: adaptive)")
    ap.add_argument("--pairs", type=int, default=None, help="A-B pairs per mode (alternating order)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default=None, help="dir for py-spy profiles of one extra run per side")
    ap.add_argument("--vllm-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default: vLLM's auto)")
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM --enforce-eager (no torch.compile)")
    ap.add_argument("--ours-threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                    help="OMP_NUM_THREADS of our LLM service; default cores - 1, the compute threads "
                         "vLLM's auto binding uses (it keeps a core for its scheduler); 0: unset")
    ap.add_argument("--ours-batch-tokens", type=int, default=None,
                    help="our max_batch_tokens (default: ours, 512; vLLM's CPU default is 2048)")
    ap.add_argument("--profile-native", action="store_true", help="py-spy --native (C/C++ frames too)")
    ap.add_argument("--lock-timeout", type=float, default=3600.0)
    ap.add_argument("--max-foreign", type=float, default=0.25,
                    help="before each run, wait until other work on the machine uses at most this many cores")
    ap.add_argument("--quiet-timeout", type=float, default=300.0, help="... but at most this long (s)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the server logs of a successful run")
    args = ap.parse_args()
    q = args.quick
    args.requests = args.requests or (12 if q else 48)
    args.concurrency = args.concurrency or (4 if q else 16)
    args.pairs = args.pairs or (1 if q else 2)
    args.prompt_range = (128, 512) if q else (128, 2048)
    args.output_range = (16, 32) if q else (64, 256)
    return args


def main() -> int:
    args = parse_args()
    if not srv.vllm_available():
        print(f"no vLLM venv at {srv.VLLM_VENV}: see shared ENV.md, 'vLLM on the CPU'", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _sigterm)  # `kill` stops the servers too, not only Ctrl-C
    t_begin = time.perf_counter()
    model_dir = srv.ensure_checkpoint()
    from transformers import AutoTokenizer

    maker = PromptMaker(AutoTokenizer.from_pretrained(model_dir), srv.word_list())
    log_dir = Path(tempfile.mkdtemp(prefix="mmserve-vs-vllm-"))
    print(f"model {model_dir}\nserver logs under {log_dir}", flush=True)
    vllm = srv.vllm_service(model_dir, log_dir, ["--enforce-eager"] if args.vllm_eager else [])
    if args.vllm_bind:
        vllm.env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_bind
    ours_env = {}
    if args.ours_threads:
        ours_env["OMP_NUM_THREADS"] = str(args.ours_threads)
    if args.ours_batch_tokens:
        ours_env["MMSERVE_LLM_MAX_BATCH_TOKENS"] = str(args.ours_batch_tokens)
    ours = srv.our_services(model_dir, log_dir, ours_env)
    url = {"vllm": vllm.url, "ours": ours[-1].url}
    runs: dict[str, dict[str, list[dict]]] = {m: {s: [] for s in SIDES} for m in ("concurrency", "rate")}
    pairs_out: dict[str, list[dict]] = {"concurrency": [], "rate": []}
    result: dict = {}
    try:
        with bench_lock(args.lock_timeout) as locked, contextlib.ExitStack() as stack:
            for svc in (vllm, *ours):
                stack.callback(svc.stop, 30.0)
            t0 = time.perf_counter()
            srv.start_vllm(vllm, timeout=900)
            startup = {"vllm_s": round(time.perf_counter() - t0, 1)}
            t0 = time.perf_counter()
            srv.start_ours(ours, timeout=300)
            startup["ours_s"] = round(time.perf_counter() - t0, 1)
            print(f"start-up: vLLM {startup['vllm_s']} s, ours {startup['ours_s']} s", flush=True)
            warm = make_trace(maker, args.seed + 99, 4, (64, 256), (8, 8))
            for side in SIDES:
                recs, _ = asyncio.run(run_load(url[side], srv.SERVED_NAME, warm, 4, None))
                if any(r.error for r in recs):
                    raise RuntimeError(f"{side} warm-up failed: {next(r.error for r in recs if r.error)}")
            meter = CpuMeter({"vllm": [vllm.proc.pid], "ours": [s.proc.pid for s in ours]})
            idle = idle_cpu(meter)
            load = {"before": os.getloadavg()[0]}
            print(f"idle CPU (cores): {idle}; load average {load['before']:.2f}", flush=True)
            rate = args.rate
            for mode_i, mode in enumerate(("concurrency", "rate")):
                if mode == "rate" and rate is None:
                    rate = rate_from(runs["concurrency"])
                for k in range(args.pairs):
                    trace = make_trace(maker, args.seed + 1000 * (mode_i + 1) + k, args.requests,
                                       args.prompt_range, args.output_range)  # fmt: skip
                    arrivals = poisson_arrivals(len(trace), rate, args.seed + k) if mode == "rate" else None
                    conc = args.concurrency if mode == "concurrency" else None
                    order = SIDES if k % 2 == 0 else SIDES[::-1]
                    recs = {}
                    for side in order:
                        quiet = wait_quiet(meter, args.max_foreign, args.quiet_timeout)
                        meter.start()
                        load_run = run_load(url[side], srv.SERVED_NAME, trace, conc, arrivals)
                        recs[side], wall = asyncio.run(load_run)
                        st = run_stats(recs[side], wall, trace)
                        st["cpu_cores"] = meter.stop()
                        st["foreign_cores_before"] = quiet
                        st["disturbed"] = st["cpu_cores"]["foreign"] > DISTURBED
                        runs[mode][side].append(st)
                        print(f"{mode:11s} pair {k} {side:4s}: {st['output_tok_s']:7.1f} tok/s  "
                              f"TTFT p50 {st['ttft_p50_ms']:8.1f} ms p90 {st['ttft_p90_ms']:8.1f} ms  "
                              f"ITL p50 {st['itl_p50_ms']:6.1f} ms  TPOT p50 {st['tpot_p50_ms']:6.1f} ms  "
                              f"wall {st['wall_s']:6.1f} s  errors {st['errors']}  short {st['short_outputs']}  "
                              f"cores {st['cpu_cores']}{'  DISTURBED' if st['disturbed'] else ''}",
                              flush=True)  # fmt: skip
                    same, prefix = agreement(recs["vllm"], recs["ours"])
                    pairs_out[mode].append({"order": list(order), "identical": same, "of": len(trace),
                                            "common_prefix_share": prefix})  # fmt: skip
                    print(f"{mode:11s} pair {k} greedy outputs identical: {same}/{len(trace)} "
                          f"(mean common prefix {prefix:.0%})", flush=True)
            load["after"] = os.getloadavg()[0]
            profiles = {}
            if args.profile:
                profiles = profile_sides(args, maker, url, {"vllm": vllm.proc.pid, "ours": ours[0].proc.pid}, meter)
            result = report(args, runs, pairs_out, rate, startup, idle, locked, profiles)
            result["load_average_1m"] = {k: round(v, 2) for k, v in load.items()}
    except KeyboardInterrupt:
        print("interrupted: servers stopped", file=sys.stderr)
        return 130
    except Exception as e:
        print(f"FAILED: {type(e).__name__}: {e}\nlogs: {log_dir}", file=sys.stderr)
        return 1
    result["total_s"] = round(time.perf_counter() - t_begin, 1)
    if not args.keep_logs:
        shutil.rmtree(log_dir, ignore_errors=True)
    print(json.dumps(result))
    return 0


def profile_sides(args, maker: PromptMaker, url: dict, pids: dict, meter: CpuMeter) -> dict:
    """One extra concurrency run per side with py-spy attached (its numbers are not in the results:
    sampling slows the server a little)."""
    out_dir = Path(args.profile)
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = make_trace(maker, args.seed + 7777, args.requests, args.prompt_range, args.output_range)
    found = {}
    for side in SIDES:
        path = out_dir / f"{side}.raw.txt"
        spy = record(pids[side], path, native=args.profile_native)
        if spy is None:
            print("py-spy not found: no profile", flush=True)
            return {}
        time.sleep(1.0)
        meter.start()
        recs, wall = asyncio.run(run_load(url[side], srv.SERVED_NAME, trace, args.concurrency, None))
        cores = meter.stop()
        spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        spy.wait(timeout=120)
        st = run_stats(recs, wall, trace)
        print(f"profiled {side}: {st['output_tok_s']} tok/s, wall {st['wall_s']} s, cores {cores}; {path}", flush=True)
        found[side] = summarize(path)
        print(format_summary(side, found[side]), flush=True)
    return {s: {k: {**v, "frames": v["frames"][:8]} for k, v in d.items()} for s, d in found.items()}


def report(args, runs, pairs_out, rate, startup, idle, locked, profiles) -> dict:
    summary = {m: {s: side_summary(runs[m][s]) for s in SIDES} for m in runs}
    print(f"\n{'mode':12s} {'side':5s} {'out tok/s':>10s} {'TTFT p50':>10s} {'TTFT p90':>10s} "
          f"{'ITL p50':>8s} {'TPOT p50':>9s} {'identical':>10s} {'disturbed':>9s}")  # fmt: skip
    ratios = {}
    for m in summary:
        agree = f"{sum(p['identical'] for p in pairs_out[m])}/{sum(p['of'] for p in pairs_out[m])}"
        for s in SIDES:
            x = summary[m][s]
            print(f"{m:12s} {s:5s} {x['output_tok_s']:10.1f} {x['ttft_p50_ms']:8.0f}ms {x['ttft_p90_ms']:8.0f}ms "
                  f"{x['itl_p50_ms']:6.1f}ms {x['tpot_p50_ms']:7.1f}ms {agree:>10s} "
                  f"{x['disturbed_runs']:>4d}/{x['runs']}")  # fmt: skip
        v, o = summary[m]["vllm"], summary[m]["ours"]
        ratios[m] = {
            "output_tok_s": round(o["output_tok_s"] / v["output_tok_s"], 3) if v["output_tok_s"] else None,
            "ttft_p50": round(o["ttft_p50_ms"] / v["ttft_p50_ms"], 3) if v["ttft_p50_ms"] else None,
            "ttft_p90": round(o["ttft_p90_ms"] / v["ttft_p90_ms"], 3) if v["ttft_p90_ms"] else None,
            "tpot_p50": round(o["tpot_p50_ms"] / v["tpot_p50_ms"], 3) if v["tpot_p50_ms"] else None,
        }
        print(f"{'':12s} ours/vLLM: tok/s x{ratios[m]['output_tok_s']}, TTFT p50 x{ratios[m]['ttft_p50']}, "
              f"TTFT p90 x{ratios[m]['ttft_p90']}, TPOT p50 x{ratios[m]['tpot_p50']}")
    strip = {m: {s: [{k: v for k, v in r.items() if not k.startswith("_")} for r in runs[m][s]] for s in SIDES}
             for m in runs}  # fmt: skip
    return {
        "benchmark": "vs_vllm",
        "quick": args.quick,
        "workload": {"requests": args.requests, "concurrency": args.concurrency, "rate_req_s": rate,
                     "pairs": args.pairs, "prompt_tokens": args.prompt_range, "output_tokens": args.output_range,
                     "seed": args.seed},
        "startup": startup,
        "threads": {"vllm": f"VLLM_CPU_OMP_THREADS_BIND={args.vllm_bind or 'auto'}",
                    "ours": f"OMP_NUM_THREADS={args.ours_threads or 'unset'}"},
        "ours_max_batch_tokens": args.ours_batch_tokens or "default (512)",
        "vllm_compile": "eager" if args.vllm_eager else "torch.compile",
        "idle_cpu_cores": idle,
        "bench_lock_held": locked,
        "summary": summary,
        "ratio_ours_over_vllm": ratios,
        "agreement": pairs_out,
        "runs": strip,
        "profiles": profiles,
    }  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
