"""Soak: a bounded run of mixed traffic (text and small-image chats, streamed and not, from
``--clients`` closed-loop clients) against ``mmserve``'s local stack (1 encoder, 1 ``swa`` LLM,
gateway), sampling the RSS of every service (the LLM with its engine core) over time, and beside
it the fill of every bounded structure that legitimately grows until it is full: the LLM's KV
pools (device and host, held by the prefix tree, whose Python bookkeeping grows with them), the
prefix tree's node count, and the gateway's cache-aware routing index.

Growth is measured only after warm-up: from the later of the end of the first third of the run
and the first sample at which every one of those structures is full. Growth before that is a
structure filling up to its configured bound, not a leak; so that the steady state arrives
early, the soak runs with small bounds (``--kv-mb``, ``--host-kv-mb``, ``--router-index-blocks``;
``--service-defaults`` keeps the services' own, with which the tiny model's ~2M-token pools take
~30K requests to fill). Reported per service (and for the LLM its front alone: the rest is its
engine core): the RSS series and the least-squares slope after warm-up in % per 30 minutes.
Target (issue 11): < 1% per 30 min. There is no baseline side: a soak measures our own
services' memory over time. The last line is JSON.

    python -m benchmarks.soak --quick       # 3 minutes
    python -m benchmarks.soak               # 30 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks import _results
from benchmarks._chat_load import closed_loop
from benchmarks._stack_util import image_part, make_png, scrape, total, user
from benchmarks.overload import rss_mb
from mmserve.launcher import LocalStack, StackSpec
from mmserve.tiny_model import write_tiny_model

FULL_AT = 0.97  # a pool this much in use counts as full (the tree evicts just ahead of demand)


def slope_pct_per_30min(ts: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ``ys`` over ``ts`` (s), as % of the mean per 30 minutes."""
    n = len(ts)
    if n < 3:
        return None
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    if var == 0 or my == 0:
        return None
    slope = sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var  # units per s
    return round(100.0 * slope * 1800.0 / my, 3)


async def clients(url: str, model: str, n: int, stop_at: float, counts: dict) -> None:
    rngs = [random.Random(k) for k in range(n)]  # client k's own stream of choices, turn after turn

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

        await closed_loop(n, turn, lambda: time.monotonic() >= stop_at)


def own_rss_mb(pid: int) -> float:
    """RSS of ``pid`` alone (``rss_mb`` adds its children: the LLM front's engine core)."""
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True)
    return round(sum(int(x) for x in out.stdout.split()) / 1024, 1)


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--minutes", type=float, default=None)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--interval", type=float, default=None, help="seconds between RSS samples")
    ap.add_argument("--model", default=None)
    ap.add_argument("--kv-mb", type=int, default=12, help="LLM device KV pools (MMSERVE_LLM_KV_BYTES)")
    ap.add_argument("--host-kv-mb", type=int, default=8, help="LLM host tier, each of full and SWA; 0: off")
    ap.add_argument("--router-index-blocks", type=int, default=1024, help="gateway routing index per replica")
    ap.add_argument("--service-defaults", action="store_true", help="no small bounds: the services' defaults")
    ap.add_argument("--malloc-arena-max", type=int, default=None, help="MALLOC_ARENA_MAX for every service")
    _results.add_mode_args(ap)
    args = ap.parse_args()
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
               "MMSERVE_LLM_HOST_KV_SWA_BYTES": str(args.host_kv_mb * mb)}
        gateway_env = {"router_index_blocks": str(args.router_index_blocks)}
        index_cap = args.router_index_blocks
    if args.malloc_arena_max:
        env["MALLOC_ARENA_MAX"] = str(args.malloc_arena_max)
    out: dict = {"bench": "soak", "quick": args.quick, "minutes": minutes, "clients": args.clients,
                 "bounds": {**env, **{f"MMSERVE_GATEWAY_{k.upper()}": v for k, v in gateway_env.items()}}
                 or "service defaults",
                 "note": "no baseline side: our services' RSS over time", "series": []}
    spec = StackSpec(model_dir=model, gateway_port=0, extra_env=env, gateway_env=gateway_env)
    with LocalStack(spec, log_dir=log_dir) as stack:
        stack.wait_ready(timeout=300)
        pids = {s.name: s.proc.pid for s in stack.services}
        fronts = {f"{s.name}/front": s.proc.pid for s in stack.llms}  # the rest is its engine core
        counts: dict = {}
        t0 = time.monotonic()
        stop_at = t0 + minutes * 60
        load = threading.Thread(target=lambda: asyncio.run(
            clients(f"{stack.url}/v1/chat/completions", stack.model_name, args.clients, stop_at, counts)))
        load.start()
        while time.monotonic() < stop_at:
            point = {"t": round(time.monotonic() - t0, 1), "requests": counts.get("ok", 0),
                     **{name: rss_mb(pid) for name, pid in pids.items()},
                     **{name: own_rss_mb(pid) for name, pid in fronts.items()}}
            point.update(bounded_fill(stack))
            point["full"] = is_full(point, index_cap)
            out["series"].append(point)
            print(point, flush=True)
            time.sleep(interval)
        load.join()
        out["counts"] = counts
    full_at = next((p["t"] for p in out["series"] if p["full"]), None)
    warm_from = max(minutes * 20, full_at if full_at is not None else 0.0)
    warm = [p for p in out["series"] if p["t"] >= warm_from]
    out["bounded_structures_full_at_s"] = full_at
    out["warm_from_s"] = warm_from
    if full_at is None:
        out["warning"] = "the bounded structures never all filled: growth below includes their filling"
    out["requests_after_warmup"] = warm[-1]["requests"] - warm[0]["requests"] if warm else 0
    names = [*pids, *fronts]
    out["growth_pct_per_30min_after_warmup"] = {
        name: slope_pct_per_30min([p["t"] for p in warm], [p[name] for p in warm]) for name in names
    }
    out["rss_mb_after_warmup"] = {name: [warm[0][name], warm[-1][name]] if warm else None for name in names}
    out["fill_after_warmup"] = {k: [warm[0].get(k), warm[-1].get(k)] for k in warm[0]
                                if k.startswith(("llm_", "gateway_"))} if warm else {}
    growth = out["growth_pct_per_30min_after_warmup"]
    _results.record("soak", ap, args, out, kind="wall-clock", baseline="none: our services' RSS over time",
                    summary=f"{minutes:g} min, {counts.get('ok', 0)} requests: growth per 30 min after warm-up "
                            + ", ".join(f"{k} {v}%" for k, v in growth.items()) + " (target < 1%)")


if __name__ == "__main__":
    _results.run(main)
