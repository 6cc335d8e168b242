"""Soak: a bounded run of mixed traffic (text and small-image chats, streamed and not, from
``--clients`` closed-loop clients) against ``mmserve``'s local stack (1 encoder, 1 ``swa`` LLM,
gateway), sampling the memory of every process of the stack over time (RSS and USS of the
gateway, the encoder, the LLM's HTTP front and its engine core, each on its own: found from the
launcher's process tree at every sample, ``benchmarks._proc_mem``), and beside it the fill of
every bounded structure that legitimately grows until it is full: the LLM's KV pools (device and
host, held by the prefix tree, whose Python bookkeeping grows with them), the prefix tree's node
count, and the gateway's cache-aware routing index.

Growth is measured only after warm-up: from the later of the end of the first third of the run
and the first sample at which every one of those structures is full (``--warmup-minutes``
overrides it). Growth before that is a structure filling up to its configured bound, or a
process's first-touch of its code and arenas, not a leak; so that the steady state arrives
early, the soak runs with small bounds (``--kv-mb``, ``--host-kv-mb``, ``--router-index-blocks``,
``--word-cache``: every prompt brings a new number, a new word for the tokenizers' word caches;
``--service-defaults`` keeps the services' own, with which the tiny model's ~2M-token pools take
~30K requests to fill). For the same reason the warm-up carries a burst (``--warmup-burst``,
as many clients again for its first 45 s in a quick run): an allocator's high-water marks (the
bodies in flight, a step's batch tensors, pymalloc's pools of small objects) are set by the
highest load a process has seen, and rise in rare page-sized steps for as long as the measured
load keeps setting new peaks; a burst above that load sets them before the fit starts. A leak
(state kept per request) grows with requests, burst or not. Reported per process: the least-squares slope of RSS over every sample
after warm-up in % (of its mean) per 30 minutes, the Theil-Sen slope beside it, the USS slope,
MB per hour, and the largest RSS slope as ``max_growth_pct_per_30min``. Target (issue 43 item
7): < 0.5% per 30 min for every process. ``--tracemalloc`` has every process write where its
Python allocations grew (``shared.memtrace``) to the log dir: for diagnosis, not a measured run.
There is no baseline side: a soak measures our own services' memory over time. The last line
is JSON.

    python -m benchmarks.soak --quick       # 3 minutes
    python -m benchmarks.soak               # 30 minutes
    python -m benchmarks.soak --minutes 60  # an hour
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks import _results
from benchmarks._chat_load import closed_loop
from benchmarks._proc_mem import memory_mb, slope_pct_per_30min, stack_processes, theil_sen_pct_per_30min
from benchmarks._stack_util import image_part, make_png, scrape, total, user
from mmserve.launcher import LocalStack, StackSpec
from mmserve.tiny_model import write_tiny_model

FULL_AT = 0.97  # a pool this much in use counts as full (the tree evicts just ahead of demand)
TARGET_PCT_PER_30MIN = 0.5  # issue 43 item 7: every process


async def clients(url: str, model: str, n: int, stop_at: float, counts: dict, burst: int = 0,
                  burst_until: float = 0.0) -> None:
    """``n`` closed-loop clients until ``stop_at``, and ``burst`` more until ``burst_until``."""
    rngs = [random.Random(k) for k in range(n + burst)]  # client k's own stream of choices, turn after turn

    async with httpx.AsyncClient(timeout=120) as c:

        async def turn(k: int, j: int) -> None:
            rng, i = rngs[k], k + j * n
            words = " ".join(rng.choice(["red", "blue", "cat", "dog", "sky", "sea"]) for _ in range(rng.randint(5, 50)))
            parts = [image_part(make_png(seed=i % 64))] if i % 3 == 0 else []
            body = {"model": model, "max_tokens": rng.randint(4, 24), "stream": i % 2 == 1,
                    "messages": [user(f"{i} {words}", *parts)]}
            try:
                r = await c.post(url, json=body)
                key = "ok" if r.status_code == 200 else str(r.status_code)
            except httpx.HTTPError as e:
                key = type(e).__name__
            counts[key] = counts.get(key, 0) + 1

        async def extra(k: int, j: int) -> None:
            await turn(n + k, j)

        await asyncio.gather(closed_loop(n, turn, lambda: time.monotonic() >= stop_at),
                             closed_loop(burst, extra, lambda: time.monotonic() >= burst_until))


def bounded_fill(stack: LocalStack) -> dict:
    """What fills up to a bound, read from the services' /metrics: the LLM's pool usage (device
    and host), its prefix-tree node count, and the gateway's routing index size."""
    out: dict = {}
    try:
        m = scrape(stack.llms[0].url)
        for pool in ("full", "swa", "host_full", "host_swa"):
            if any(n == "mmserve_llm_kv_pool_usage" and ("pool", pool) in ls for n, ls in m):
                out[f"llm_{pool}_usage"] = round(total(m, "mmserve_llm_kv_pool_usage", pool=pool), 4)
        out["llm_tree_nodes"] = int(total(m, "mmserve_llm_kv_tree_nodes"))
        for kind in ("in_use", "free"):
            out[f"llm_front_malloc_{kind}_mb"] = round(total(m, "mmserve_llm_malloc_bytes", kind=kind) / 2**20, 2)
        g = scrape(stack.gateway.url)
        out["gateway_router_index_blocks"] = int(total(g, "mmserve_gateway_router_index_blocks"))
        for kind in ("in_use", "free"):  # glibc heap: live native + Python blocks, and held-but-free
            out[f"gateway_malloc_{kind}_mb"] = round(total(g, "mmserve_gateway_malloc_bytes", kind=kind) / 2**20, 2)
    except (httpx.HTTPError, ValueError) as e:
        out["scrape_error"] = f"{type(e).__name__}: {e}"
    return out


def is_full(fill: dict, index_cap: int | None) -> bool:
    """Every bounded structure at its bound (pools at ``FULL_AT``, the routing index at its cap;
    ``index_cap`` None: the gateway's default bound, not expected to fill in a soak)."""
    pools = [v for k, v in fill.items() if k.endswith("_usage") and "swa" not in k]
    if not pools or "scrape_error" in fill:
        return False
    index_ok = index_cap is None or fill.get("gateway_router_index_blocks", 0) >= index_cap
    return all(v >= FULL_AT for v in pools) and index_ok


def _stop(*_) -> None:
    raise KeyboardInterrupt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--minutes", type=float, default=None)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--interval", type=float, default=None, help="seconds between RSS samples")
    ap.add_argument("--warmup-burst", type=int, default=None,
                    help="clients added for the first three quarters of the warm-up third (default: --clients): "
                         "each process's allocator high-water marks (in-flight bodies, batches, pools of small "
                         "objects) are set by a higher load than the measured one, as the small bounds fill the "
                         "bounded structures early; 0: none")
    ap.add_argument("--model", default=None)
    ap.add_argument("--kv-mb", type=int, default=12, help="LLM device KV pools (MMSERVE_LLM_KV_BYTES)")
    ap.add_argument("--host-kv-mb", type=int, default=8, help="LLM host tier, each of full and SWA; 0: off")
    ap.add_argument("--word-cache", type=int, default=64,
                    help="words each LLM prep thread's tokenizer remembers (MMSERVE_LLM_TOKENIZER_WORD_CACHE; every "
                         "soak prompt brings a new number, so the default 2048 fills over the first ~4k requests)")
    ap.add_argument("--router-index-blocks", type=int, default=1024, help="gateway routing index per replica")
    ap.add_argument("--service-defaults", action="store_true", help="no small bounds: the services' defaults")
    ap.add_argument("--malloc-arena-max", type=int, default=None, help="MALLOC_ARENA_MAX for every service")
    ap.add_argument("--service-env", action="append", default=[], metavar="NAME=VALUE",
                    help="an environment variable for every service (repeatable), e.g. the engine core's "
                         "allocator: MMSERVE_LLM_CORE_MALLOC=system")
    ap.add_argument("--warmup-minutes", type=float, default=None,
                    help="growth is fitted from here on (default: the later of a third of the run and the "
                         "bounded structures all full)")
    ap.add_argument("--tracemalloc", action="store_true",
                    help="every process traces its Python allocations (MMSERVE_TRACEMALLOC=1) and writes where "
                         "they grew to the log dir every --interval x 6 s (slows the services: not a measured run, no "
                         "results file)")
    _results.add_mode_args(ap)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, _stop)  # a `timeout` or `kill` still stops the stack (its own sessions)
    minutes = args.minutes or (0.15 if args.smoke else 3.0 if args.quick else 30.0)
    interval = args.interval or (2.0 if args.smoke else 5.0 if args.quick else 20.0)
    log_dir = Path(tempfile.mkdtemp(prefix="mmserve-soak-"))
    model = args.model or str(write_tiny_model(log_dir / "tiny-mimo", arch="mimo"))
    env: dict[str, str] = {}
    gateway_env: dict[str, str] = {}
    index_cap = None
    if not args.service_defaults:
        mb = 1024 * 1024
        env = {"MMSERVE_LLM_KV_BYTES": str(args.kv_mb * mb),
               "MMSERVE_LLM_HOST_KV_FULL_BYTES": str(args.host_kv_mb * mb),
               "MMSERVE_LLM_HOST_KV_SWA_BYTES": str(args.host_kv_mb * mb),
               "MMSERVE_LLM_TOKENIZER_WORD_CACHE": str(args.word_cache)}
        gateway_env = {"router_index_blocks": str(args.router_index_blocks)}
        index_cap = args.router_index_blocks
    if args.malloc_arena_max:
        env["MALLOC_ARENA_MAX"] = str(args.malloc_arena_max)
    for item in args.service_env:
        name, _, value = item.partition("=")
        env[name] = value
    out: dict = {"bench": "soak", "quick": args.quick, "minutes": minutes, "clients": args.clients,
                 "bounds": {**env, **{f"MMSERVE_GATEWAY_{k.upper()}": v for k, v in gateway_env.items()}}
                 or "service defaults",
                 "note": "no baseline side: our services' memory over time, process by process", "series": []}
    if args.tracemalloc:
        env.update({"MMSERVE_TRACEMALLOC": "1", "MMSERVE_TRACEMALLOC_DIR": str(log_dir / "tracemalloc"),
                    "MMSERVE_TRACEMALLOC_INTERVAL": str(interval * 6)})
        out["tracemalloc"] = str(log_dir / "tracemalloc")
    spec = StackSpec(model_dir=model, gateway_port=0, extra_env=env, gateway_env=gateway_env)
    with LocalStack(spec, log_dir=log_dir) as stack:
        stack.wait_ready(timeout=300)
        roots = {s.name: s.proc.pid for s in stack.services}
        llms = {s.name for s in stack.llms}
        counts: dict = {}
        t0 = time.monotonic()
        stop_at = t0 + minutes * 60
        burst = args.clients if args.warmup_burst is None else args.warmup_burst
        burst_until = t0 + minutes * 60 / 3 * 0.75
        out["warmup_burst"] = {"clients": burst, "until_s": round(minutes * 60 / 3 * 0.75, 1)}
        load = threading.Thread(target=lambda: asyncio.run(
            clients(f"{stack.url}/v1/chat/completions", stack.model_name, args.clients, stop_at, counts,
                    burst, burst_until)), daemon=True)
        load.start()
        while time.monotonic() < stop_at:
            point: dict = {"t": round(time.monotonic() - t0, 1), "requests": counts.get("ok", 0),
                           "pid": {}, "rss_mb": {}, "uss_mb": {}}
            for name, pid in stack_processes(roots, llms).items():
                mem = memory_mb(pid)
                if mem is not None:
                    point["pid"][name] = pid
                    point["rss_mb"][name], point["uss_mb"][name] = mem
            point.update(bounded_fill(stack))
            point["full"] = is_full(point, index_cap)
            out["series"].append(point)
            print({k: v for k, v in point.items() if k != "pid"}, flush=True)
            time.sleep(interval)
        load.join()
        out["counts"] = counts
    out.update(growth_after_warmup(out["series"], minutes, args.warmup_minutes))
    growth = out["growth_pct_per_30min_after_warmup"]
    if args.tracemalloc:  # a diagnostic run (tracing slows and grows every process): no results file
        print(json.dumps({**out, "benchmark": "soak", "kind": "wall-clock", "mode": _results.mode_of(args),
                          "diagnostic": "--tracemalloc"}, default=str), flush=True)
        return
    _results.record("soak", ap, args, out, kind="wall-clock", baseline="none: our services' memory over time",
                    summary=f"{minutes:g} min, {counts.get('ok', 0)} requests: RSS growth per 30 min after warm-up "
                            f"(from {out['warm_from_s']:g} s) "
                            + ", ".join(f"{k} {v}%" for k, v in growth.items())
                            + f"; max {out['max_growth_pct_per_30min']}% (target < {TARGET_PCT_PER_30MIN}%)")


def growth_after_warmup(series: list[dict], minutes: float, warmup_minutes: float | None) -> dict:
    """Each process's RSS and USS slope after warm-up (least squares over every sample from
    ``warm_from_s``; Theil-Sen beside it), MB per hour, and the largest RSS slope. A process is
    fitted over the samples where its pid is the one it has at the end (a restarted engine core
    starts a new series)."""
    full_at = next((p["t"] for p in series if p["full"]), None)
    if warmup_minutes is not None:
        warm_from = warmup_minutes * 60
    else:
        warm_from = max(minutes * 20, full_at if full_at is not None else 0.0)
    warm = [p for p in series if p["t"] >= warm_from]
    out: dict = {"bounded_structures_full_at_s": full_at, "warm_from_s": warm_from,
                 "warm_from_rule": "--warmup-minutes" if warmup_minutes is not None
                 else "the later of a third of the run and the bounded structures all full"}
    if full_at is None:
        out["warning"] = "the bounded structures never all filled: growth below includes their filling"
    out["requests_after_warmup"] = warm[-1]["requests"] - warm[0]["requests"] if warm else 0
    names = list(warm[-1]["rss_mb"]) if warm else []
    fit, robust, uss, per_hour, ends, late = {}, {}, {}, {}, {}, {}
    for name in names:
        pts = [p for p in warm if p["pid"].get(name) == warm[-1]["pid"][name]]
        ts = [p["t"] for p in pts]
        rss = [p["rss_mb"][name] for p in pts]
        fit[name] = slope_pct_per_30min(ts, rss)
        robust[name] = theil_sen_pct_per_30min(ts, rss)
        uss[name] = slope_pct_per_30min(ts, [p["uss_mb"][name] for p in pts])
        per_hour[name] = round(fit[name] * 2 * sum(rss) / len(rss) / 100, 3) if fit[name] is not None else None
        ends[name] = [rss[0], rss[-1]] if rss else None
        half = len(ts) // 2
        late[name] = slope_pct_per_30min(ts[half:], rss[half:])
    out["growth_pct_per_30min_after_warmup"] = fit
    out["growth_pct_per_30min_after_warmup_theil_sen"] = robust
    out["uss_growth_pct_per_30min_after_warmup"] = uss
    # the same fit over the later half of those samples: below the whole fit where growth is
    # still slowing down (the tail of warm-up), about equal where it is steady (a leak)
    out["growth_pct_per_30min_later_half"] = late
    out["rss_growth_mb_per_hour_after_warmup"] = per_hour
    out["rss_mb_after_warmup"] = ends
    out["fill_after_warmup"] = {k: [warm[0].get(k), warm[-1].get(k)] for k in warm[0]
                                if k.startswith(("llm_", "gateway_"))} if warm else {}
    known = [v for v in fit.values() if v is not None]
    out["max_growth_pct_per_30min"] = max(known) if known else None
    out["max_growth_process"] = max((k for k in fit if fit[k] is not None), key=fit.get, default=None)
    out["target_pct_per_30min"] = TARGET_PCT_PER_30MIN
    return out


if __name__ == "__main__":
    _results.run(main)
