"""Two gateways in front of 4 LLM replicas (tiny model, ``swa``): prefix hit and TTFT with the
router on the replicas' KV events vs each gateway's own guess vs one gateway alone (it sees every
turn: the reference for what two gateways should reach) vs round-robin, one run.

Workload: ``benchmarks.e2e_load``'s multi-turn multimodal chat (seeded; shared system prompts,
images, clips, tones; each turn = the previous turn + the answer + a new user message). Each
turn goes to the *other* gateway than the previous turn (a Service spreading a user's requests
over gateway replicas), so a gateway's own record misses half of every conversation.

Sides share one set of services (1 encoder, 4 LLM replicas publishing KV events on the local
Redis): only the gateways are started per side, with ``kv_events_url`` (events),
``cache_aware`` without it (own guess; ``one_gateway``: a single one) or ``round_robin``. Each
side runs ``--repeats`` times, the order reversed every other repeat, after an uncounted
warm-up; hit and TTFT pool every repeat's requests. Each side's system prompts and texts
carry the side's own tag, so no side hits what another cached. Measured per side: prefix hit
ratio (sum ``cached_tokens`` / sum ``prompt_tokens`` of the usage chunks), TTFT p50 / p90 at the
client. Target (issue 22): events' hit within 2% of one gateway's, >= 1.2x round-robin's.

    python -m benchmarks.router_events [--quick] [--sessions N] [--turns T] [--repeats R] [--concurrency C] [--seed S]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
import uuid

from benchmarks import _results
from benchmarks._chat_load import drive, openai_client
from benchmarks._stats import percentile, scaled
from benchmarks.e2e_load import SYSTEM_PROMPTS, SideResult, make_workload, media_pools, stream_turn
from benchmarks._stack_util import user
from mmserve.launcher import LocalStack, Service, StackSpec, free_port, wait_ready

REDIS = "redis://127.0.0.1:6379/0"
LLMS = 4
SIDES = ("events", "one_gateway", "own_guess", "round_robin")
TARGET_VS_RR = 1.2
TARGET_VS_ONE = 0.98


async def run_session(clients, model: str, session, pools, result: SideResult, tag: str, first: int) -> None:
    messages = [{"role": "system", "content": f"[{tag}] " + SYSTEM_PROMPTS[session.system]}]
    for k, turn in enumerate(session.turns):
        messages.append(user(f"[{tag}] {turn.text}", *(pools[m][i] for m, i in turn.media)))
        client = clients[(first + k) % len(clients)]  # turns alternate between the gateways
        text = await stream_turn(client, model, messages, turn.max_tokens, result, k)
        if text is None:
            return
        messages.append({"role": "assistant", "content": text})


async def run_workload(urls: list[str], model: str, workload, pools, concurrency: int, tag: str) -> SideResult:
    """Every session, ``concurrency`` at a time (``benchmarks._chat_load.drive``); session i's
    first turn goes to gateway i mod len(urls)."""
    result = SideResult()
    clients = [openai_client(u, timeout=300) for u in urls]
    try:
        _, result.wall_s = await drive(
            len(workload), lambda i: run_session(clients, model, workload[i], pools, result, tag, first=i), concurrency
        )
    finally:
        for c in clients:
            await c.close()
    return result


def gateway_services(stack: LocalStack, side: str, stream: str, log_dir: str) -> list[Service]:
    env = {k: v for k, v in stack.gateway.env.items() if not k.startswith("MMSERVE_GATEWAY_KV_EVENTS")}
    if side == "events":
        env.update(MMSERVE_GATEWAY_KV_EVENTS_URL=REDIS, MMSERVE_GATEWAY_KV_EVENTS_STREAM=stream)
    env["MMSERVE_GATEWAY_LLM_ROUTING"] = "round_robin" if side == "round_robin" else "cache_aware"
    env["MMSERVE_GATEWAY_HEALTH_INTERVAL"] = "1"
    out = []
    for g in range(1 if side == "one_gateway" else 2):
        port = free_port()
        argv = [a for a in stack.gateway.argv]
        argv[argv.index("--port") + 1] = str(port)
        out.append(Service(f"gateway-{side}-{g}", f"http://127.0.0.1:{port}", argv, env,
                           stack.log_dir / f"gateway-{side}-{g}.log"))
    return out


def run_side(stack: LocalStack, side: str, stream: str, workload, pools, concurrency: int, log_dir: str) -> dict:
    gws = gateway_services(stack, side, stream, log_dir)
    try:
        for g in gws:
            g.start()
        wait_ready(gws, timeout=120)
        time.sleep(2.0)  # a readiness probe of every replica (instance ids) and the snapshots loaded
        res = asyncio.run(run_workload([g.url for g in gws], stack.model_name, workload, pools, concurrency,
                                       tag=f"{side}-{uuid.uuid4().hex[:8]}"))
    finally:
        for g in gws:
            g.terminate()
        for g in gws:
            g.stop()
    ttfts = [r.ttft for r in res.records if r.ttft is not None]
    prompt = sum(r.prompt_tokens for r in res.records)
    cached = sum(r.cached_tokens for r in res.records)
    return {
        "side": side, "requests": len(res.records), "errors": len(res.errors),
        "first_error": res.errors[0] if res.errors else None, "wall_s": round(res.wall_s, 2),
        "prefix_cache_hit_ratio": round(cached / prompt, 4) if prompt else 0.0,
        "prompt_tokens": prompt, "cached_tokens": cached,
        "ttft_p50_ms": scaled(percentile(ttfts, 50), 1000), "ttft_p90_ms": scaled(percentile(ttfts, 90), 1000),
        "ttfts": ttfts,
    }


def _pooled(runs: list[dict]) -> dict:
    """One side over its repeats: hit over all tokens, TTFT percentiles over all requests."""
    prompt = sum(r["prompt_tokens"] for r in runs)
    cached = sum(r["cached_tokens"] for r in runs)
    ttfts = [t for r in runs for t in r["ttfts"]]
    return {
        "runs": len(runs), "requests": sum(r["requests"] for r in runs), "errors": sum(r["errors"] for r in runs),
        "prefix_cache_hit_ratio": round(cached / prompt, 4) if prompt else 0.0,
        "prefix_hit_runs": [r["prefix_cache_hit_ratio"] for r in runs],
        "ttft_p50_ms": scaled(percentile(ttfts, 50), 1000), "ttft_p90_ms": scaled(percentile(ttfts, 90), 1000),
        "ttft_p90_ms_runs": [r["ttft_p90_ms"] for r in runs],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 sessions x 4 turns per side, 2 repeats")
    ap.add_argument("--sessions", type=int, default=None)
    ap.add_argument("--turns", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None, help="runs per side, order reversed every other repeat")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="bundle dir (default: the tiny mimo bundle)")
    _results.add_mode_args(ap)
    args = ap.parse_args()
    sessions = args.sessions or (2 if args.smoke else 8 if args.quick else 16)
    turns = args.turns or (2 if args.smoke else 4 if args.quick else 6)
    repeats = args.repeats or (1 if args.smoke else 2 if args.quick else 3)

    from mmserve.cli import ensure_default_model

    model_dir = ensure_default_model(args.model)
    workload = make_workload(args.seed, sessions, turns)
    pools = media_pools()
    stream = f"mmserve:kv-events:bench-{uuid.uuid4().hex[:8]}"
    log_dir = tempfile.mkdtemp(prefix="mmserve-router-events-")
    print(f"workload: {sessions} sessions x {turns} turns per side, concurrency {args.concurrency}, "
          f"2 gateways (one_gateway: 1) x {LLMS} LLM replicas, {repeats} repeat(s); logs under {log_dir}", flush=True)
    spec = StackSpec(model_dir=model_dir, gateway_port=0, encoders=1, llms=LLMS, llm_backend="swa",
                     extra_env={"MMSERVE_LLM_KV_EVENTS_URL": REDIS, "MMSERVE_LLM_KV_EVENTS_STREAM": stream})
    base = list(SIDES)
    random.Random(args.seed).shuffle(base)
    orders = [base if k % 2 == 0 else base[::-1] for k in range(repeats)]  # A-B-C-D, D-C-B-A, ...
    per_side: dict[str, list[dict]] = {s: [] for s in SIDES}
    with LocalStack(spec, log_dir=log_dir) as stack:
        stack.wait_ready(timeout=600)
        # warm-up (its own tag, not counted): no side pays the replicas' first requests
        run_side(stack, "one_gateway", stream, workload[:2], pools, args.concurrency, log_dir)
        for order in orders:
            for side in order:
                r = run_side(stack, side, stream, workload, pools, args.concurrency, log_dir)
                per_side[side].append(r)
                print(f"{side:12s} prefix hit {r['prefix_cache_hit_ratio']:.3f} ({r['cached_tokens']}/"
                      f"{r['prompt_tokens']})  TTFT p50 {r['ttft_p50_ms']:7.1f} ms  p90 {r['ttft_p90_ms']:7.1f} ms  "
                      f"errors {r['errors']}", flush=True)
    runs = {s: _pooled(rs) for s, rs in per_side.items()}
    ev, one, own, rr = (runs[s]["prefix_cache_hit_ratio"] for s in ("events", "one_gateway", "own_guess", "round_robin"))

    def ratio(a: float, b: float) -> float | None:
        return round(a / b, 3) if b else None

    ratios = {
        "hit_events_over_round_robin": ratio(ev, rr),
        "hit_events_over_one_gateway": ratio(ev, one),
        "hit_events_over_own_guess": ratio(ev, own),
        "ttft_p90_events_over_round_robin": ratio(runs["events"]["ttft_p90_ms"], runs["round_robin"]["ttft_p90_ms"]),
        "ttft_p90_events_over_own_guess": ratio(runs["events"]["ttft_p90_ms"], runs["own_guess"]["ttft_p90_ms"]),
        "ttft_p90_events_over_one_gateway": ratio(runs["events"]["ttft_p90_ms"], runs["one_gateway"]["ttft_p90_ms"]),
    }
    errors = sum(r["errors"] for r in runs.values())
    met_rr = bool(ratios["hit_events_over_round_robin"] and ratios["hit_events_over_round_robin"] >= TARGET_VS_RR)
    met_one = bool(ratios["hit_events_over_one_gateway"] and ratios["hit_events_over_one_gateway"] >= TARGET_VS_ONE)
    print(f"prefix hit, events over: round-robin x{ratios['hit_events_over_round_robin']} (target >= x{TARGET_VS_RR}: "
          f"{'met' if met_rr else 'NOT met'}), one gateway x{ratios['hit_events_over_one_gateway']} (target >= "
          f"x{TARGET_VS_ONE}: {'met' if met_one else 'NOT met'}), two gateways' own guesses "
          f"x{ratios['hit_events_over_own_guess']}; TTFT p90 x{ratios['ttft_p90_events_over_round_robin']} vs "
          f"round-robin, x{ratios['ttft_p90_events_over_own_guess']} vs own guesses", flush=True)
    figures = {"quick": args.quick, "workload": {"sessions": sessions, "turns": turns, "concurrency": args.concurrency,
                                                 "gateways": 2, "llm_replicas": LLMS, "seed": args.seed,
                                                 "repeats": repeats},
               "side_orders": orders, "sides": runs, "ratios": ratios,
               "target_vs_round_robin_met": met_rr, "target_vs_one_gateway_met": met_one,
               "target_met": met_rr and met_one and errors == 0}
    _results.record("router_events", ap, args, figures, kind="wall-clock", baseline="round_robin, one gateway's own "
                    "guess, and each of two gateways' own guess; same services and run, sides alternated",
                    summary=f"prefix hit events x{ratios['hit_events_over_round_robin']} round-robin, "
                            f"x{ratios['hit_events_over_one_gateway']} one gateway, "
                            f"x{ratios['hit_events_over_own_guess']} two gateways' own guesses")
    return 0 if errors == 0 else 1


if __name__ == "__main__":
    _results.run(main)
