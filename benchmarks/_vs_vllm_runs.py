"""The measuring half of ``benchmarks.vs_vllm``: each side's configuration (preloads, threads,
binding), a ``Group`` of servers (one model at one KV budget and max length, both sides or one
in a sweep) with what its processes really run with, one measured run (client load, CPU meter,
the servers' own prefix-cache counters), a trace's A-B / B-A pairs, and the per-side sweep."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from pathlib import Path

from benchmarks import _vs_vllm_servers as srv
from benchmarks._bench_host import CpuMeter, process_report, wait_quiet
from benchmarks._chat_load import (
    PromptMaker, agreement, make_agent_trace, make_trace, poisson_arrivals, run_agent, run_load, run_stats,
    side_summary,
)  # fmt: skip

SIDES = ("vllm", "ours")
TRACES = ("chat", "long", "agent")
MODES = {"chat": ("concurrency", "rate"), "long": ("concurrency",), "agent": ("sessions",)}
DISTURBED = 0.3  # foreign cores during a run above which its numbers are flagged
LONG_LEN = 8192
VLLM_FACTS = {
    "default_binding": "VLLM_CPU_OMP_THREADS_BIND=auto, world size 1, x86: one logical CPU per physical core, "
                       "minus reserve_cpu_num = local_world_size = 1 core (the last) kept for the API server and "
                       "engine core; the worker gets OMP_NUM_THREADS = cores left, OMP_PLACES + OMP_PROC_BIND=true "
                       "(KMP_AFFINITY with libiomp preloaded). vllm/utils/ompmultiprocessing.py: "
                       "OMPProcessManager.__init__ (reserve_cpu_num), _get_autobind_cpu_ids, configure_omp_envs. "
                       "A kv_transfer_config reserves one more core.",
    "kv_offload": "not available on the CPU platform: --kv-offloading-size -> OffloadingConnector, whose "
                  "CPUOffloadingSpec.get_worker raises 'CPU Offloading is currently only supported on CUDA-alike "
                  "and XPU GPUs' (vllm/v1/kv_offload/cpu/spec.py); SimpleCPUOffloadConnector uses torch.cuda streams",
    "prefix_caching": "on (V1 default, CacheConfig.enable_prefix_caching = True; not changed here)",
    "kv_budget_flag": "--kv-cache-memory-bytes (VLLM_CPU_KVCACHE_SPACE is int GiB only: vllm/platforms/cpu.py)",
}  # fmt: skip



# ---- configurations of each side ---------------------------------------------------------------
def resolve_preload(kind: str) -> str:
    """``auto``: tcmalloc + Intel OpenMP when both are found, else whichever is; '' for none."""
    if kind == "auto":
        for k in ("tcmalloc+iomp", "tcmalloc", "iomp"):
            if srv.preload(k):
                return srv.preload(k)
        return ""
    return srv.preload(kind) if kind != "none" else ""


def cfg_label(side: str, cfg: dict) -> str:
    if side == "vllm":
        pre = cfg["ld_preload"] and "+".join(Path(p).name.split(".")[0] for p in cfg["ld_preload"].split(":"))
        return f"bind={cfg['bind']} preload={pre or 'none'}{' eager' if cfg.get('eager') else ''}"
    return (f"threads={cfg.get('threads') or 'default'} batch_tokens={cfg.get('batch_tokens') or 'default'} "
            f"preload={'tcmalloc' if cfg.get('ld_preload') else 'none'} host_kv={cfg.get('host_kv', 'default')}"
            + (f" core_malloc={cfg['malloc']}" if cfg.get("malloc") else "")
            + (f" small_step_threads={cfg['small_threads']}" if cfg.get("small_threads") is not None else ""))


def ours_torch_threads(model_dir: Path, threads: int | None) -> int | None:
    """The engine core's torch.set_num_threads, as the service computes it (``core_threads``)."""
    try:
        from llm_svc.core.process import core_threads
        from shared.settings import LLMSettings

        return core_threads(LLMSettings(model_dir=str(model_dir), threads=threads or 0))
    except Exception:  # noqa: BLE001 - a record, not a requirement
        return None


class Group:
    """The servers of one model and one KV / length setting (both sides, or one in a sweep)."""

    def __init__(self, args, model: str, name: str, model_dir: Path, max_len: int, kv_bytes: int,
                 cfgs: dict[str, dict], log_dir: Path, sides=SIDES):  # fmt: skip
        self.model, self.name, self.model_dir, self.max_len, self.kv_bytes = model, name, model_dir, max_len, kv_bytes
        self.cfgs, self.sides, self.args = cfgs, tuple(sides), args
        self.served = srv.MODELS[model].served_name
        tag = f"{model}-{name}"
        self.svc: dict[str, list] = {}
        if "vllm" in self.sides:
            c = cfgs["vllm"]
            env = {"LD_PRELOAD": c["ld_preload"], "VLLM_CPU_OMP_THREADS_BIND": "" if c["bind"] == "auto" else c["bind"]}
            self.svc["vllm"] = [srv.vllm_service(model_dir, log_dir, self.served, max_len, kv_bytes,
                                                 ["--enforce-eager"] if c.get("eager") else [], env, f"{tag}-vllm",
                                                 dtype=getattr(args, "dtype", "float32"))]
        if "ours" in self.sides:
            c = cfgs["ours"]
            env = {"LD_PRELOAD": c.get("ld_preload", ""),
                   "MMSERVE_LLM_THREADS": str(c["threads"]) if c.get("threads") else "",
                   "MMSERVE_LLM_MAX_BATCH_TOKENS": str(c["batch_tokens"]) if c.get("batch_tokens") else "",
                   "MMSERVE_LLM_CORE_MALLOC": c.get("malloc", ""),
                   "MMSERVE_LLM_SMALL_STEP_THREADS": "" if c.get("small_threads") is None else str(c["small_threads"])}
            if c.get("host_kv") == "off":
                env |= {"MMSERVE_LLM_HOST_KV_FULL_BYTES": "0", "MMSERVE_LLM_HOST_KV_SWA_BYTES": "0"}
            self.svc["ours"] = srv.our_services(model_dir, log_dir, env, self.served, max_len, kv_bytes, f"{tag}-ours",
                                                dtype=getattr(args, "dtype", "float32"))
        self.url = {s: v[-1].url for s, v in self.svc.items()}
        self.metrics_url = {s: v[0].url for s, v in self.svc.items()}  # vLLM itself / our LLM service
        self.startup: dict[str, float] = {}
        self.record: dict[str, dict] = {}

    def start(self, stack: contextlib.ExitStack) -> None:
        for side in self.sides:
            for s in self.svc[side]:
                stack.callback(s.stop, 30.0)
            t0 = time.perf_counter()
            if side == "vllm":
                srv.start_vllm(self.svc["vllm"][0], timeout=900)
            else:
                srv.start_ours(self.svc["ours"], timeout=300)
            self.startup[side] = round(time.perf_counter() - t0, 1)
        print(f"[{self.model}/{self.name}] start-up: " + ", ".join(f"{s} {t} s" for s, t in self.startup.items())
              + f"; max model len {self.max_len}, KV {self.kv_bytes / 2**30:g} GiB", flush=True)  # fmt: skip

    def stop(self) -> None:
        for v in self.svc.values():
            for s in v:
                s.stop(30.0)

    def roots(self) -> dict[str, list[int]]:
        return {s: [x.proc.pid for x in v] for s, v in self.svc.items()}

    def warm(self, maker: PromptMaker, seed: int, long: bool) -> None:
        batches = [make_trace(maker, seed + 99, 4, (64, 256), (8, 8))]
        if long:  # the first long prefill may compile new shapes (vLLM) or grow buffers (both)
            batches.append(make_trace(maker, seed + 98, 1, (3000, 3000), (4, 4)))
        for side in self.sides:
            for b in batches:
                recs, _ = asyncio.run(run_load(self.url[side], self.served, b, 4, None))
                if any(r.error for r in recs):
                    raise RuntimeError(f"{side} warm-up failed: {next(r.error for r in recs if r.error)}")

    def kv_tokens(self) -> dict[str, int | None]:
        """Each side's KV capacity in tokens as its log says (vLLM: "CPU KV cache size: N tokens";
        ours: "N full / M swa slots", the full-layer slots)."""
        out = {}
        for side in self.sides:
            rx = r"KV cache size: ([\d,]+) tokens" if side == "vllm" else r"(\d+) full / \d+ swa slots"
            lines = srv.log_lines(self.svc[side][0].log_path, rx)
            m = re.search(rx, lines[-1]) if lines else None
            out[side] = int(m.group(1).replace(",", "")) if m else None
        return out

    def describe(self) -> dict:
        """What each side actually runs with (after warm-up, so OpenMP pools exist)."""
        out = {}
        for side in self.sides:
            svcs = self.svc[side]
            procs = [row for s in svcs for row in process_report(s.proc.pid)]
            rec = {"config": {**self.cfgs[side], "label": cfg_label(side, self.cfgs[side])},
                   "startup_s": self.startup.get(side), "max_model_len": self.max_len, "kv_bytes": self.kv_bytes,
                   "processes": procs}  # fmt: skip
            if side == "vllm":
                rec["log"] = srv.log_lines(svcs[0].log_path, srv.VLLM_LOG_FACTS)
                rec["compile"] = "eager" if self.cfgs[side].get("eager") else "torch.compile"
            else:
                rec["log"] = srv.log_lines(svcs[0].log_path, srv.OURS_LOG_FACTS)
                rec["torch_threads"] = ours_torch_threads(self.model_dir, self.cfgs[side].get("threads"))
                rec["MMSERVE_LLM_THREADS"] = self.cfgs[side].get("threads") or "unset"
                rec["host_kv"] = ("off" if self.cfgs[side].get("host_kv") == "off"
                                  else "default: host_kv_full_bytes 512 MiB + host_kv_swa_bytes 64 MiB")
            rec["kv_tokens"] = self.kv_tokens()[side]
            out[side] = rec
        return out


def prefix_delta(side: str, before: dict, after: dict) -> dict:
    hits_k, q_k = srv.PREFIX_METRICS[side]
    d = {"hits": after.get(hits_k, 0.0) - before.get(hits_k, 0.0),
         "queries": after.get(q_k, 0.0) - before.get(q_k, 0.0)}
    if side == "vllm":
        eh, eq = srv.EXTERNAL_PREFIX
        if eh in after:
            d["external_hits"] = after[eh] - before.get(eh, 0.0)
            d["external_queries"] = after.get(eq, 0.0) - before.get(eq, 0.0)
    else:  # our KV tiers: tokens moved per tier and direction over the run
        d["tier_tokens"] = {k.split("{", 1)[1].rstrip("}"): round(v - before.get(k, 0.0))
                            for k, v in after.items() if k.startswith("mmserve_llm_kv_tier_tokens{")
                            and v - before.get(k, 0.0)}  # fmt: skip
    d["hit_rate"] = round(d["hits"] / d["queries"], 4) if d["queries"] else None
    return d


def measure(args, g: Group, meter: CpuMeter, side: str, payload, conc=None, arrivals=None) -> tuple[list, dict]:
    quiet = wait_quiet(meter, args.max_foreign, args.quiet_timeout)
    before = srv.scrape(g.metrics_url[side])
    meter.start()
    if isinstance(payload, tuple):  # agent: (system, sessions)
        recs, wall = asyncio.run(run_agent(g.url[side], g.served, *payload))
    else:
        recs, wall = asyncio.run(run_load(g.url[side], g.served, payload, conc, arrivals))
    st = run_stats(recs, wall)
    st["cpu_cores"] = meter.stop()
    st["server_prefix"] = prefix_delta(side, before, srv.scrape(g.metrics_url[side]))
    st["foreign_cores_before"] = quiet
    st["disturbed"] = st["cpu_cores"]["foreign"] > DISTURBED
    return recs, st


def _line(label: str, st: dict) -> str:
    hr = st["server_prefix"].get("hit_rate")
    return (f"{label}: {st['output_tok_s']:7.1f} tok/s  TTFT p50 {st['ttft_p50_ms']:8.1f} ms p90 "
            f"{st['ttft_p90_ms']:8.1f} ms  ITL p50 {st['itl_p50_ms']:6.1f} ms  TPOT p50 {st['tpot_p50_ms']:6.1f} ms  "
            f"wall {st['wall_s']:6.1f} s  prefix hit {'-' if hr is None else f'{hr:.0%}'}  errors {st['errors']}  "
            f"short {st['short_outputs']}  cores {st['cpu_cores']}{'  DISTURBED' if st['disturbed'] else ''}")


def rate_from(conc_runs: dict[str, list[dict]]) -> float:
    """0.7 x the slower side's req/s at fixed concurrency (undisturbed runs when there are some),
    so the rate mode measures latency at a load both sides sustain."""
    def req_s(rs: list[dict]) -> float:
        calm = [r for r in rs if not r["disturbed"]] or rs
        return side_summary(calm)["req_s"]

    return round(0.7 * min(req_s(conc_runs[s]) for s in SIDES), 4)


# ---- traces ------------------------------------------------------------------------------------
def workload(args, trace: str) -> dict:
    q = args.quick
    if trace == "chat":
        return {"requests": args.requests, "concurrency": args.concurrency, "prompt_tokens": args.prompt_range,
                "output_tokens": args.output_range}
    if trace == "long":
        return {"requests": 4 if q else 16, "concurrency": 2 if q else 4, "prompt_tokens": (3000, 7000),
                "output_tokens": (16, 32) if q else (32, 64)}
    return {"sessions": args.agent_sessions, "turns": args.agent_turns, "system_tokens": 1536,
            "task_tokens": (64, 128), "tool_tokens": (300, 500) if q else (200, 400),
            "output_tokens": (16, 32) if q else (32, 64)}


def working_set(w: dict, facts: dict, kv_bytes: int, capacity: dict | None = None) -> dict:
    """Distinct prompt tokens of an agent trace (the shared system prompt once, each session's
    task, tool results and answers; mean sizes) and their KV at every layer, against the KV
    budget and against each side's own KV capacity in tokens (``capacity``: vLLM's "CPU KV cache
    size: N tokens", our full-layer slots; both from their start-up logs)."""
    per_turn = (w["tool_tokens"][0] + w["tool_tokens"][1]) / 2 + (w["output_tokens"][0] + w["output_tokens"][1]) / 2
    task = (w["task_tokens"][0] + w["task_tokens"][1]) / 2
    tokens = int(w["system_tokens"] + w["sessions"] * (task + (w["turns"] - 1) * per_turn))
    b = tokens * facts["kv_bytes_per_token_all_layers"]
    out = {"distinct_tokens": tokens, "kv_bytes_all_layers": b, "times_kv_budget": round(b / kv_bytes, 2),
           "kv_bytes_full_layers_only": tokens * facts["kv_bytes_per_token_full_layers"]}
    for side, cap in (capacity or {}).items():
        if cap:
            out[f"times_{side}_kv_tokens"] = round(tokens / cap, 2)
    return out


def agent_max_len(w: dict) -> int:
    """4096 when the longest session fits (with room for the template), else 8192."""
    turn = w["tool_tokens"][1] + w["output_tokens"][1]
    longest = w["system_tokens"] + w["task_tokens"][1] + (w["turns"] - 1) * turn + w["output_tokens"][1]
    return srv.MAX_MODEL_LEN if longest + 32 * w["turns"] + 64 <= srv.MAX_MODEL_LEN else LONG_LEN


def run_trace(args, g: Group, meter: CpuMeter, maker: PromptMaker, trace: str) -> dict:
    w = workload(args, trace)
    runs = {m: {s: [] for s in SIDES} for m in MODES[trace]}
    pairs_out: dict[str, list[dict]] = {m: [] for m in MODES[trace]}
    rate = args.rate
    base = args.seed + {"chat": 0, "long": 50_000, "agent": 90_000}[trace]
    for mode_i, mode in enumerate(MODES[trace]):
        if mode == "rate" and rate is None:
            rate = rate_from(runs["concurrency"])
        for k in range(args.pairs):
            seed = base + 1000 * (mode_i + 1) + k
            conc = arrivals = None
            if trace == "agent":
                payload = make_agent_trace(maker, seed, w["sessions"], w["turns"], w["system_tokens"],
                                           w["task_tokens"], w["tool_tokens"], w["output_tokens"])  # fmt: skip
                n = w["sessions"] * w["turns"]
            else:
                payload = make_trace(maker, seed, w["requests"], w["prompt_tokens"], w["output_tokens"])
                n = len(payload)
                if mode == "rate":
                    arrivals = poisson_arrivals(n, rate, args.seed + k)
                else:
                    conc = w["concurrency"]
            order = SIDES if k % 2 == 0 else SIDES[::-1]
            recs = {}
            for side in order:
                recs[side], st = measure(args, g, meter, side, payload, conc, arrivals)
                runs[mode][side].append(st)
                print(_line(f"{g.model}/{trace} {mode:11s} pair {k} {side:4s}", st), flush=True)
            same, prefix = agreement(recs["vllm"], recs["ours"])
            pairs_out[mode].append({"order": list(order), "identical": same, "of": n, "common_prefix_share": prefix})
            print(f"{g.model}/{trace} {mode:11s} pair {k} greedy outputs identical: {same}/{n} "
                  f"(mean common prefix {prefix:.0%})", flush=True)
    summary = {m: {s: side_summary(runs[m][s]) for s in SIDES} for m in runs}
    ratios = {m: ratios_of(summary[m]["ours"], summary[m]["vllm"]) for m in summary}
    strip = {m: {s: [{k: v for k, v in r.items() if not k.startswith("_")} for r in runs[m][s]] for s in SIDES}
             for m in runs}  # fmt: skip
    out = {"workload": {**w, "pairs": args.pairs, "rate_req_s": rate if trace == "chat" else None},
           "summary": summary, "ratio_ours_over_vllm": ratios, "agreement": pairs_out, "runs": strip}
    if trace == "agent":
        out["working_set"] = working_set(w, srv.checkpoint_facts(g.model_dir), g.kv_bytes, g.kv_tokens())
    return out


def ratios_of(o: dict, v: dict) -> dict:
    def r(key):
        return round(o[key] / v[key], 3) if o.get(key) and v.get(key) else None

    return {"output_tok_s": r("output_tok_s"), "ttft_p50": r("ttft_p50_ms"), "ttft_p90": r("ttft_p90_ms"),
            "itl_p50": r("itl_p50_ms"), "tpot_p50": r("tpot_p50_ms"),
            "prefix_hit_rate_usage": r("prefix_hit_rate_usage"), "prefix_hit_rate_server": r("prefix_hit_rate_server")}


# ---- sweep -------------------------------------------------------------------------------------
def sweep_configs(args) -> dict[str, list[dict]]:
    auto = resolve_preload("auto")
    allc = f"0-{(len(os.sched_getaffinity(0)) or 2) - 1}"
    vllm = [{"bind": "auto", "ld_preload": ""}, {"bind": "auto", "ld_preload": auto},
            {"bind": allc, "ld_preload": auto}]
    # the core preloads tcmalloc itself where the system has it (core_malloc=auto): glibc is the variant
    ours = [{}, {"threads": len(os.sched_getaffinity(0))}, {"batch_tokens": 2048}, {"small_threads": 0}]
    if srv.find_tcmalloc():
        ours.append({"malloc": "system"})
    dedupe = lambda cs: [dict(t) for t in dict.fromkeys(tuple(sorted(c.items())) for c in cs)]  # noqa: E731
    return {"vllm": [c | {"eager": args.vllm_eager} for c in dedupe(vllm)], "ours": dedupe(ours)}


def run_sweep(args, model: str, model_dir: Path, maker: PromptMaker, log_dir: Path) -> dict:
    """Each configuration alone: its server(s) up, warm-up, one quick chat concurrency run, down."""
    trace = make_trace(maker, args.seed + 4242, 12, (128, 512), (16, 32))
    out: dict = {}
    for side, cfgs in sweep_configs(args).items():
        out[side] = []
        for i, cfg in enumerate(cfgs):
            g = Group(args, model, f"sweep-{side}{i}", model_dir, srv.MAX_MODEL_LEN, int(args.kv_gib * 2**30),
                      {side: cfg}, log_dir, sides=(side,))  # fmt: skip
            try:
                with contextlib.ExitStack() as local:
                    g.start(local)
                    g.warm(maker, args.seed, long=False)
                    desc = g.describe()[side]
                    meter = CpuMeter(g.roots())
                    _, st = measure(args, g, meter, side, trace, 4)
            except Exception as e:  # noqa: BLE001 - a config that does not start is a result too
                print(f"sweep {model} {side} [{cfg_label(side, cfg)}]: FAILED {type(e).__name__}: "
                      f"{str(e)[:300]}", flush=True)  # fmt: skip
                out[side].append({"config": cfg, "label": cfg_label(side, cfg),
                                  "error": f"{type(e).__name__}: {e}"[:600]})
                continue
            print(_line(f"sweep {model} {side} [{cfg_label(side, cfg)}]", st), flush=True)
            out[side].append({"config": cfg, "label": cfg_label(side, cfg), "startup_s": g.startup.get(side),
                              **{k: v for k, v in st.items() if not k.startswith("_")},
                              "processes": desc["processes"], "log": desc["log"]})  # fmt: skip
    best = {}
    for side, rows in out.items():
        ok = [r for r in rows if "error" not in r and not r["errors"]]
        calm = [r for r in ok if not r["disturbed"]] or ok
        if calm:
            best[side] = max(calm, key=lambda r: r["output_tok_s"])["config"]
    out["best"] = best
    print(f"sweep {model} best: " + "; ".join(f"{s}: {cfg_label(s, c)}" for s, c in best.items()), flush=True)
    return out
