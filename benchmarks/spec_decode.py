"""Speculative decoding, ours and vLLM 0.32's on the CPU, side by side (issue 23's ``spec_decode``):
output tok/s, TTFT and TPOT with speculation off, with n-gram drafts (k = ``--ngram-k``), with MTP
drafts where served, on a chat trace and on a copy-heavy agent trace, at 1, 4 and 16 requests in
flight, and the acceptance each speculating side reaches. Wall-clock, not a simulation.

Checkpoint: ``--model DIR`` (default: the random-weight MiMo-V2-Flash-form checkpoint of
``benchmarks.vs_vllm``, ``~/.cache/mmserve/bench/mimo-v2-flash-...``, with 3 random MTP layers
added unless ``--no-mtp`` (``_spec_sides.default_checkpoint``: the LM's weights are vs_vllm's);
with random weights the acceptance says how often a weak model repeats its context or itself,
and the MTP sides' little more than their cost). The trained checkpoints: ``--model
mmserve/tiny/trained_mimo_qkv`` (qk = v head dims: every side, vLLM's included) and ``--model
mmserve/tiny/trained_mimo`` (qk != v: ours only, the vLLM sides skipped with the reason,
``_spec_sides.vllm_cpu_refusal``). Every side serves that directory, float32,
greedy (temperature 0), ``ignore_eos``, the same ``max_tokens`` and the same prompts; streamed
``/v1/chat/completions`` through our gateway (as ``vs_vllm``) and vLLM's OpenAI server.

Sides (``benchmarks._spec_sides.side_list``, one list entry each, all up at once):
``ours-off``, ``ours-ngram{k}`` per ``--ngram-k`` (2, 4), ``ours-mtp1`` and ``ours-mtp`` (MTP with
one layer, with all the checkpoint's layers: a service that refuses a configuration is recorded
with its reason and skipped), ``vllm-off``, ``vllm-ngram{k}`` per ``--vllm-ngram-k`` (4; a refusal
is recorded the same way), ``vllm-mtp1`` only for a checkpoint with MTP layers (vLLM's
``mimo_v2_mtp`` runs one MTP layer; the default checkpoint has them). n-gram bounds
``--ngram-min`` / ``--ngram-max`` (1 / 3) on both engines. vLLM runs with ``vs_vllm``'s defaults
(``VLLM_CPU_OMP_THREADS_BIND=auto``: one OpenMP thread bound to core 0; tcmalloc + Intel OpenMP
preloaded); ours with the service's.

Traces (``benchmarks._spec_traces``; seeded, fresh prompts for every run so no run hits an
earlier one's prefix cache): ``chat``, a question about one standard-library function with its
docstring (48-160 prompt tokens), 128 output tokens (64 --quick); ``agent``, a copy-heavy edit: a
1024-token chunk (512 --quick) of a standard-library module and "rename X to X_v2 and write out
the whole code", 256 output tokens (128 --quick). Concurrency ``--concurrency`` (1, 4, 16) with
4 / 8 / 32 requests (2 / 4 / 16 --quick).

Each (trace, concurrency) runs the sides in the order A-B-...-B-A (two runs per side, fresh
prompts each), ``--rounds`` times (2; 1 --quick). Per side: output tok/s (completion tokens /
run wall time, mean over runs), TTFT p50 (request sent -> first content chunk), TPOT p50 ((last
chunk - first chunk) / (tokens - 1) per request), ITL p50 (gaps between content chunks: a burst
of accepted tokens may arrive as one chunk), all wall-clock; for speculating sides the mean
acceptance length (1 + accepted / drafts), acceptance rate and acceptance per draft position
(accepted at j / drafts, vLLM's meaning), from deltas of each server's own counters over its runs
(ours ``mmserve_llm_spec_decode_*``, vLLM ``vllm:spec_decode_*``); greedy outputs compared with
``ours-off``'s. Ratios: each speculating side / ``ours-off`` (and vLLM's / ``vllm-off``), ours'
best / vLLM's best, ours' best speculating / vLLM's best speculating (its smallest over traces and
concurrencies: ``figures.min_ratio_ours_spec_over_vllm_spec``; the default automatic configuration's
smallest over spec off: ``figures.min_ratio_auto_over_off``); "stops paying" is the
lowest concurrency where no speculating side of ours beats ``ours-off``. Runs hold the benchmark
lock from the first server start; before each run the benchmark waits (up to
``--quiet-timeout``) for other work to use at most ``--max-foreign`` cores; a run with more than
0.3 foreign cores is marked DISTURBED.

Cost on the 2-core box: ``--quick`` about 6 min on a quiet machine (all servers up together in
~1.5 min, 60 runs of 1-10 s), 12 min when others' work keeps it busy (each run first waits up to
5 s for quiet); the full run about 3x the runs;
``--smoke`` (CI): ``ours-off`` and ``ours-ngram2`` only, tiny prompts, concurrency 1 and 2, one
A-B pass, ~30 s.

    python -m benchmarks.spec_decode [--quick] [--model DIR] [--ngram-k 2 4] [--vllm-ngram-k 4]
        [--ngram-min 1] [--ngram-max 3] [--no-mtp] [--no-vllm] [--only SIDE ...] [--traces chat agent]
        [--concurrency 1 4 16] [--rounds N] [--kv-gib G] [--seed S] [--keep-logs]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import _results
from benchmarks import _spec_sides as sides_mod
from benchmarks import _spec_traces as traces
from benchmarks import _vs_vllm_servers as srv
from benchmarks._bench_host import CpuMeter, bench_lock, idle_cpu, wait_quiet
from benchmarks._chat_load import drive, one_request, openai_client, run_stats, side_summary

NAME = "spec_decode"
SERVED = "spec-bench"
DISTURBED = 0.3  # foreign cores during a run above which its numbers are flagged


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter traces, fewer requests, one A-B-B-A round")
    ap.add_argument("--model", default=None, help="checkpoint dir (default: vs_vllm's MiMo benchmark checkpoint)")
    ap.add_argument("--ngram-k", type=int, nargs="+", default=[2, 4], help="our n-gram num_speculative_tokens")
    ap.add_argument("--vllm-ngram-k", type=int, nargs="+", default=[4], help="vLLM's n-gram num_speculative_tokens")
    ap.add_argument("--ngram-min", type=int, default=1, help="prompt_lookup_min (both engines)")
    ap.add_argument("--ngram-max", type=int, default=3, help="prompt_lookup_max (both engines)")
    ap.add_argument("--no-mtp", dest="mtp", action="store_false", help="leave the MTP sides out")
    ap.add_argument("--no-vllm", dest="vllm", action="store_false", help="ours only")
    ap.add_argument("--only", nargs="+", default=None, help="run only these sides (names as listed)")
    ap.add_argument("--traces", nargs="+", choices=("chat", "agent"), default=["chat", "agent"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=None, help="requests in flight (1 4 16)")
    ap.add_argument("--rounds", type=int, default=None, help="A-B-B-A rounds per trace and concurrency (2; 1 quick)")
    ap.add_argument("--kv-gib", type=float, default=0.5, help="KV budget of every server")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lock-timeout", type=float, default=3600.0)
    ap.add_argument("--max-foreign", type=float, default=0.25,
                    help="before each run, wait until other work on the machine uses at most this many cores")
    ap.add_argument("--quiet-timeout", type=float, default=None, help="... but at most this long (s; 30, 5 quick)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the server logs of a successful run")
    _results.add_mode_args(ap)
    args = ap.parse_args()
    args.parser = ap
    q = args.quick
    if args.smoke:
        args.ngram_k, args.mtp, args.vllm, args.concurrency, args.rounds = [2], False, False, [1, 2], 1
        args.chat_prompt, args.chat_out, args.agent_context, args.agent_out = (24, 64), 8, 96, 12
        args.requests, args.quiet_timeout = {1: 1, 2: 2}, 0.0  # one 1-s probe per run, no waiting
    else:
        args.concurrency = args.concurrency or [1, 4, 16]
        args.quiet_timeout = args.quiet_timeout if args.quiet_timeout is not None else (5.0 if q else 30.0)
        args.rounds = args.rounds or (1 if q else 2)
        args.chat_prompt, args.chat_out = (48, 160), 64 if q else 128
        args.agent_context, args.agent_out = (512, 128) if q else (1024, 256)
        per = {1: 2, 4: 4, 16: 16} if q else {1: 4, 4: 8, 16: 32}
        args.requests = {c: per.get(c, max(2, c) if q else 2 * c) for c in args.concurrency}
    return args


def make_requests(args, tok, trace: str, conc: int, seed: int) -> list[traces.Request]:
    n = args.requests[conc]
    if trace == "chat":
        return traces.chat_trace(tok, seed, n, args.chat_prompt, args.chat_out)
    return traces.agent_trace(tok, seed, n, args.agent_context, args.agent_out)


async def _send(url: str, reqs: list[traces.Request], conc: int):
    """Records in request order and the wall time (first send -> last answer), ``conc`` in flight."""
    client = openai_client(url)
    try:
        return await drive(len(reqs), lambda i: one_request(client, SERVED, list(reqs[i].messages), reqs[i].max_tokens),
                           conc)
    finally:
        await client.close()


def measure(args, side: sides_mod.Side, meter: CpuMeter, reqs: list[traces.Request], conc: int):
    quiet = wait_quiet(meter, args.max_foreign, args.quiet_timeout, probe_s=1.0)
    engine = side.spec.engine
    before = sides_mod.spec_counters(engine, srv.scrape(side.metrics_url))
    meter.start()
    recs, wall = asyncio.run(_send(side.url, reqs, conc))
    cores = meter.stop()
    time.sleep(0.3)  # our counters arrive with the core's last outputs
    after = sides_mod.spec_counters(engine, srv.scrape(side.metrics_url))
    st = run_stats(recs, wall)
    st.update(cpu_cores=cores, foreign_cores_before=quiet, disturbed=cores["foreign"] > DISTURBED,
              spec=sides_mod.spec_delta(before, after))  # fmt: skip
    return recs, st


def _identical(a, b) -> int:
    return sum(x.error is None and y.error is None and x.text == y.text for x, y in zip(a, b))


def run_cell(args, live: list, meter: CpuMeter, tok, trace: str, conc: int) -> dict:
    """Every live side on (trace, conc): per round A..Z then Z..A, fresh prompts per pass."""
    runs = {s.name: [] for s in live}
    same = {s.name: [0, 0] for s in live}  # identical to ours-off, of
    passes = 2 * args.rounds if not args.smoke else 1
    for p in range(passes):
        seed = args.seed + {"chat": 0, "agent": 500_000}[trace] + 1000 * conc + p
        reqs = make_requests(args, tok, trace, conc, seed)
        order = live if p % 2 == 0 else live[::-1]
        recs = {}
        for side in order:
            recs[side.name], st = measure(args, side, meter, reqs, conc)
            runs[side.name].append(st)
            acc = sides_mod.acceptance(st["spec"])
            print(f"{trace:5s} c={conc:<2d} pass {p} {side.name:12s} {st['output_tok_s']:7.1f} tok/s  "
                  f"TTFT p50 {st['ttft_p50_ms']:7.1f} ms  TPOT p50 {st['tpot_p50_ms']:6.1f} ms  "
                  f"ITL p50 {st['itl_p50_ms']:6.1f} ms  wall {st['wall_s']:5.1f} s  "
                  f"acc len {acc['mean_acceptance_length'] or '-'}  errors {st['errors']}  cores {st['cpu_cores']}"
                  f"{'  DISTURBED' if st['disturbed'] else ''}", flush=True)  # fmt: skip
        ref = recs.get("ours-off")
        for name, r in recs.items():
            if ref is not None:
                same[name][0] += _identical(ref, r)
                same[name][1] += len(r)
    out = {}
    for name, rs in runs.items():
        out[name] = {**side_summary(rs), **sides_mod.acceptance(sides_mod.spec_sum([r["spec"] for r in rs])),
                     "identical_to_ours_off": f"{same[name][0]}/{same[name][1]}" if same[name][1] else None,
                     "runs_detail": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rs]}  # fmt: skip
    return {"requests": args.requests[conc], "passes": passes, "sides": out}


def _r(a, b):
    return round(a / b, 3) if a and b else None


def ratios(cell: dict) -> dict:
    """Speculating side / its engine's spec-off side; ours' best / vLLM's best (any setting, and
    speculating only), by output tok/s."""
    s = {k: v["output_tok_s"] for k, v in cell["sides"].items()}
    out = {}
    for name, v in s.items():
        base = "ours-off" if name.startswith("ours") else "vllm-off"
        if name != base and base in s:
            out[f"{name}_over_{base}"] = _r(v, s[base])

    def best(prefix: str, spec_only: bool):
        c = {k: v for k, v in s.items() if k.startswith(prefix) and not (spec_only and k.endswith("-off"))}
        return max(c.items(), key=lambda kv: kv[1]) if c else (None, None)

    for tag, spec_only in (("best", False), ("best_spec", True)):
        (on, ov), (vn, vv) = best("ours", spec_only), best("vllm", spec_only)
        out[f"ours_{tag}_over_vllm_{tag}"] = _r(ov, vv)
        out[f"ours_{tag}"], out[f"vllm_{tag}"] = on, vn
    return out


def min_auto_over_off(results: dict) -> float | None:
    """The smallest tok/s ratio over spec-off, over traces and concurrencies, of the default
    configuration (the automatic draft length): MTP where the checkpoint has it, else the best
    automatic n-gram side."""
    worst = None
    for cells in results.values():
        for cell in cells.values():
            r = cell.get("ratios", {})
            v = r.get("ours-mtp_over_ours-off")
            if v is None:
                v = max((x for k, x in r.items() if k.startswith("ours-ngram") and "-fixed" not in k
                         and k.endswith("_over_ours-off") and x), default=None)
            if v is not None:
                worst = v if worst is None else min(worst, v)
    return worst


def min_ours_spec_over_vllm_spec(results: dict) -> float | None:
    """The smallest ratio of ours' best speculating side to vLLM's best speculating side (output
    tok/s), over traces and concurrencies; None where a cell lacks either side (no vLLM run)."""
    vs = [cell["ratios"].get("ours_best_spec_over_vllm_best_spec") for cells in results.values()
          for cell in cells.values()]  # fmt: skip
    return min(vs) if vs and all(v is not None for v in vs) else None


def stops_paying(results: dict, conc: list[int]) -> dict:
    """Per trace: the lowest concurrency where no speculating side of ours beats ours-off (None:
    it pays at every concurrency measured), and the best ratio at each."""
    out = {}
    for trace, cells in results.items():
        best = {}
        for c in conc:
            r = [v for k, v in cells[str(c)]["ratios"].items() if k.startswith("ours-") and k.endswith("_over_ours-off")
                 and v is not None]  # fmt: skip
            best[c] = max(r) if r else None
        stop = next((c for c in conc if best[c] is not None and best[c] <= 1.0), None)
        out[trace] = {"stops_at_concurrency": stop, "best_ours_spec_over_off": best}
    return out


def report(results: dict, live: list) -> None:
    print(f"\n{'trace':6s} {'conc':>4s} {'side':12s} {'out tok/s':>9s} {'/off':>6s} {'TTFT p50':>9s} {'TPOT p50':>9s} "
          f"{'ITL p50':>8s} {'acc len':>7s} {'acc/pos':>22s} {'same':>6s} {'dist':>4s}")  # fmt: skip
    for trace, cells in results.items():
        for c, cell in cells.items():
            for s in live:
                x, r = cell["sides"][s.name], cell["ratios"]
                base = "ours-off" if s.name.startswith("ours") else "vllm-off"
                rel = r.get(f"{s.name}_over_{base}")
                pos = ",".join(f"{a:.2f}" for a in x["acceptance_per_pos"] or []) or "-"
                print(f"{trace:6s} {c:>4s} {s.name:12s} {x['output_tok_s']:9.1f} {rel or '':>6} "
                      f"{x['ttft_p50_ms']:7.0f}ms {x['tpot_p50_ms']:7.1f}ms {x['itl_p50_ms']:6.1f}ms "
                      f"{x['mean_acceptance_length'] or '-':>7} {pos:>22s} "
                      f"{x['identical_to_ours_off'] or '-':>6s} {x['disturbed_runs']}/{x['runs']:<2d}")  # fmt: skip
            r = cell["ratios"]
            print(f"{'':11s} ours best {r['ours_best']} / vLLM best {r['vllm_best']}: "
                  f"x{r['ours_best_over_vllm_best']}; speculating: {r['ours_best_spec']} / {r['vllm_best_spec']}: "
                  f"x{r['ours_best_spec_over_vllm_best_spec']}")


def summary_line(results: dict, stops: dict) -> str:
    parts = []
    for trace, cells in results.items():
        best = stops[trace]["best_ours_spec_over_off"]
        vs = [f"c{c} x{cell['ratios']['ours_best_over_vllm_best']}" for c, cell in cells.items()]
        acc = [f"{k} {v['mean_acceptance_length']}" for k, v in next(iter(cells.values()))["sides"].items()
               if v["mean_acceptance_length"]]  # fmt: skip
        parts.append(f"{trace}: best spec / off tok/s " + ", ".join(f"c{c} x{v}" for c, v in best.items())
                     + f" (stops paying at c={stops[trace]['stops_at_concurrency']}); ours best / vLLM best "
                     + ", ".join(vs) + (f"; acceptance length at c1: {', '.join(acc)}" if acc else ""))
    return "; ".join(parts)


def targets(results: dict, sides: dict) -> dict:
    """Issue 23's and 47's targets that this run can judge (n-gram on the copy-heavy trace >= 1.5x
    spec off; the default (automatic) configuration >= 0.97x spec off everywhere; ours speculating
    >= 1x (23) and >= 1.2x (47) vLLM's speculating at every concurrency; the MTP ones when served)."""
    out = {}
    agent = results.get("agent", {})
    if agent:
        ng = [max((v for k, v in cell["ratios"].items() if k.startswith("ours-ngram") and v), default=0)
              for cell in agent.values()]  # fmt: skip
        out["ngram_agent_over_off_ge_1.5"] = {"best_per_concurrency": ng, "met": bool(ng) and min(ng) >= 1.5}
    vs = [cell["ratios"]["ours_best_spec_over_vllm_best_spec"] for cells in results.values() for cell in cells.values()]
    if vs and all(v is not None for v in vs):
        out["ours_spec_over_vllm_spec_ge_1.0"] = {"values": vs, "met": min(vs) >= 1.0}
        out["ours_spec_over_vllm_spec_ge_1.2"] = {"min": min(vs), "met": min(vs) >= 1.2}
    auto = min_auto_over_off(results)
    if auto is not None:
        out["auto_over_off_ge_0.97"] = {"min": auto, "met": auto >= 0.97}
    if "ours-mtp" not in sides or sides["ours-mtp"].get("refused"):
        out["mtp"] = "not judged: MTP not served (" + (sides.get("ours-mtp", {}).get("refused") or "not run") + ")"
    return out


def _sigterm(*_):
    raise KeyboardInterrupt


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, _sigterm)  # `kill` stops the servers too, not only Ctrl-C
    if args.vllm and not srv.vllm_available():
        print(f"no vLLM venv at {srv.VLLM_VENV}: run with --no-vllm, or see shared ENV.md", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    # absolute: every server gets the path, whatever its working directory
    model_dir = Path(args.model).resolve() if args.model else sides_mod.default_checkpoint(args)
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    max_len = min(srv.MAX_MODEL_LEN, int(cfg.get("max_position_embeddings") or srv.MAX_MODEL_LEN))
    specs = sides_mod.side_list(args, model_dir)
    if args.only:
        specs = [s for s in specs if s.name in args.only]
    log_dir = Path(tempfile.mkdtemp(prefix="mmserve-spec-decode-"))
    print(f"model {model_dir}; server logs under {log_dir}", flush=True)
    t_begin = time.perf_counter()
    results: dict = {}
    try:
        with bench_lock(args.lock_timeout) as locked, contextlib.ExitStack() as stack:
            built = [sides_mod.build(s, model_dir, log_dir, SERVED, max_len, int(args.kv_gib * 2**30))
                     for s in specs if not s.skip]  # fmt: skip
            sides_mod.start_all(built, stack, timeout=900)
            live = [s for s in built if not s.refused]
            for s in specs:
                if s.skip:
                    print(f"{s.name}: skipped: {s.skip}", flush=True)
            for s in built:
                print(f"{s.name}: " + (f"REFUSED: {s.refused}" if s.refused else
                                       f"up ({s.startup_s} s, started together); config {s.served_config}"), flush=True)
            if "ours-off" not in {s.name for s in live}:
                raise RuntimeError("ours-off did not start: no baseline")
            meter = CpuMeter({s.name: s.pids() for s in live})
            for s in live:  # warm-up: first-request compiles (vLLM), buffers, the drafting paths
                for trace in args.traces:
                    reqs = make_requests(args, tok, trace, 1, args.seed + 99)[:1] * 2
                    reqs = [traces.Request(r.messages, 8, r.prompt_tokens) for r in reqs]
                    recs, _ = asyncio.run(_send(s.url, reqs, 2))
                    if any(r.error for r in recs):
                        raise RuntimeError(f"{s.name} warm-up failed: {next(r.error for r in recs if r.error)}")
            idle = idle_cpu(meter, 2.0)
            print(f"idle CPU (cores): {idle}", flush=True)
            for trace in args.traces:
                results[trace] = {}
                for c in args.concurrency:
                    cell = run_cell(args, live, meter, tok, trace, c)
                    cell["ratios"] = ratios(cell)
                    results[trace][str(c)] = cell
            server_logs = {s.name: srv.log_lines(s.services[0].log_path, srv.VLLM_LOG_FACTS + r"|speculat|ngram"
                                                 if s.spec.engine == "vllm" else srv.OURS_LOG_FACTS + r"|speculat")
                           for s in live}  # fmt: skip
    except KeyboardInterrupt:
        print("interrupted: servers stopped", file=sys.stderr)
        return 130
    except Exception as e:
        print(f"FAILED: {type(e).__name__}: {e}\nlogs: {log_dir}", file=sys.stderr)
        return 1
    report(results, live)
    stops = stops_paying(results, args.concurrency)
    for trace, st in stops.items():
        print(f"{trace}: best speculating / ours-off by concurrency {st['best_ours_spec_over_off']}; "
              f"stops paying at {st['stops_at_concurrency'] or 'none measured'}", flush=True)
    side_info = {s.name: {"engine": s.engine, "speculative_config": s.spec, "skipped": s.skip} for s in specs}
    for s in built:
        side_info[s.name].update(refused=s.refused, startup_s=s.startup_s, served_config=s.served_config,
                                 log=server_logs.get(s.name, []))  # fmt: skip
    flat = {f"{t}/c{c}/{k}": v for t, cells in results.items() for c, cell in cells.items()
            for k, v in cell["ratios"].items() if isinstance(v, float)}  # fmt: skip
    figures = {
        "model_dir": str(model_dir), "checkpoint": _facts(model_dir), "max_model_len": max_len,
        "kv_bytes": int(args.kv_gib * 2**30), "bench_lock_held": locked, "idle_cpu_cores": idle,
        "workload": {"concurrency": args.concurrency, "requests": args.requests, "rounds": args.rounds,
                     "chat_prompt_tokens": args.chat_prompt, "chat_max_tokens": args.chat_out,
                     "agent_context_tokens": args.agent_context, "agent_max_tokens": args.agent_out,
                     "greedy": True, "ignore_eos": True},
        "wall_clock": ["output_tok_s", "ttft_p50_ms", "tpot_p50_ms", "itl_p50_ms"],
        "sides": side_info, "results": results, "ratios": flat, "stops_paying": stops,
        "min_ratio_auto_over_off": min_auto_over_off(results),
        "min_ratio_ours_spec_over_vllm_spec": min_ours_spec_over_vllm_spec(results),
        "targets": targets(results, side_info), "total_s": round(time.perf_counter() - t_begin, 1),
    }  # fmt: skip
    if not args.keep_logs:
        shutil.rmtree(log_dir, ignore_errors=True)
    skipped = ["vLLM sides (start-up takes minutes on 2 cores), MTP sides, the B-A half of each round, "
               "concurrency 16: ours-off and ours-ngram2 only, concurrency 1 and 2"] if args.smoke else []
    _results.record(NAME, args.parser, args, figures, kind="wall-clock", skipped=skipped,
                    baseline="ours with speculation off; vLLM 0.32 CPU (off and n-gram) on the same checkpoint",
                    summary=summary_line(results, stops))  # fmt: skip
    return 0


def _facts(model_dir: Path) -> dict:
    try:
        return {**srv.checkpoint_facts(model_dir), "mtp_layers": sides_mod.mtp_layers(model_dir)}
    except (OSError, KeyError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


if __name__ == "__main__":
    sys.exit(main())
