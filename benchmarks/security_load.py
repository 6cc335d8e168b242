"""Security under load: the attacks of issue 42, each sent ``--repeats`` times while a steady
streaming chat load runs against the same stack, beside quiet runs of the same load (no
attacks) as long as the attack runs, alternated (attack, quiet, quiet, attack ...) so drift
weighs on both sides alike.

The stack is ``mmserve up``'s (gateway, one encoder, one LLM service as local processes) on the
tiny omni MiMo (it takes images, video and audio), with an API key, a service token, the
encoders' embeddings and the LLMs' L3 KV tier in Redis (when one answers on 127.0.0.1:6379).
The steady load: ``--clients`` closed-loop streaming chats (one user text, ``--max-tokens``
tokens, ``ignore_eos``). Attacks go one at a time, round-robin over the kinds, from another
task; ``/healthz`` of the gateway and of the LLM front is polled every 50 ms throughout, from a
process of its own.

Per attack: the status codes answered and the refusal time (median, max). Per run: TTFT and ITL
p99 of the steady load. Figures: the attack runs' p99 over the quiet runs' (``max_p99_ratio``:
the larger of TTFT and ITL; target <= 1.2) and the slowest ``/healthz`` (``max_healthz_ms``,
target <= 100). Wall-clock. The last line is a JSON object.

    python -m benchmarks.security_load --quick   # ~7 minutes: 2 quiet + 2 attack runs, 4 repeats
    python -m benchmarks.security_load           # ~20 minutes: 20 repeats per attack, 3 runs per side

The hostile schema is refused by its compile's CPU-time limit (10 s at the lowest priority, the
first 1 s at full speed and the rest at a quarter of a core: about 85 s of wall time under the
load), so it goes ``--slow-repeats`` times per run, not 20.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks import _results
from benchmarks._stats import percentile
from benchmarks._chat_load import closed_loop
from benchmarks._security_attacks import ATTACKS, AttackContext
from mmserve.launcher import LocalStack, StackSpec
from mmserve.tiny_model import write_tiny_model
from shared.gc_tuning import freeze_startup_heap

API_KEY = "bench-security-key"
SERVICE_TOKEN = "bench-security-service-token"
PEER_KEY = "bench-security-peer-key-0123456789"


async def _steady(url: str, model: str, clients: int, max_tokens: int, stop: asyncio.Event) -> dict:
    """Closed-loop streaming chats until ``stop``: TTFT and ITL samples (seconds), errors."""
    ttft: list[float] = []
    itl: list[float] = []
    errors: list[str] = []
    headers = {"authorization": f"Bearer {API_KEY}"}

    async with httpx.AsyncClient(base_url=url, timeout=120) as c:

        async def turn(k: int, i: int) -> None:
            body = {"model": model, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"steady client {k} turn {i} tell me a story"}]}
            t0 = last = time.perf_counter()
            first = True
            try:
                async with c.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
                    if r.status_code != 200:
                        errors.append(f"HTTP {r.status_code}")
                        await r.aread()
                        return
                    async for line in r.aiter_lines():
                        if not line.startswith("data: {") or '"content"' not in line:
                            continue
                        now = time.perf_counter()
                        (ttft.append(now - t0) if first else itl.append(now - last))
                        first, last = False, now
            except httpx.HTTPError as e:
                errors.append(type(e).__name__)

        await closed_loop(clients, turn, stop.is_set)
    return {"ttft": ttft, "itl": itl, "errors": errors}


def _healthz(urls: dict[str, str], stop, current, out) -> None:
    """The slowest /healthz answer (ms) of each of ``urls`` (name -> base URL), polled every 50 ms
    until ``stop`` is set, and the attack in flight (``current``) when it was slowest; put on
    ``out``. In a process of its own: on the load generator's event loop, every probe would also
    wait for that loop's turn (up to 60 ms with the steady load alone on 2 cores), a delay of
    the client's, not of the server under test. Its start-up heap (this module imports torch) is
    frozen out of the garbage collector first: a full collection over it stopped this process for
    ~100 ms, which the probe in flight then counted as the server's."""
    freeze_startup_heap("the /healthz prober")

    async def go() -> dict:
        worst = {name: (0.0, None) for name in urls}
        async with httpx.AsyncClient(timeout=10) as c:
            while not stop.is_set():
                for name, u in urls.items():
                    t0 = time.perf_counter()
                    try:
                        await c.get(u + "/healthz")
                        ms = (time.perf_counter() - t0) * 1000
                    except httpx.HTTPError:
                        ms = 10_000.0
                    if ms > worst[name][0]:
                        worst[name] = (round(ms, 1), current.value.decode() or None)
                await asyncio.sleep(0.05)
        return worst

    out.put(asyncio.run(go()))


def _attacker(ctx: AttackContext, names: list[str], repeats: int, slow_repeats: int, current, out) -> None:
    """The attack side, in a process of its own (building and sending the attacks must not take
    the load generator's event loop): each attack ``repeats`` times, round-robin, one at a time;
    the slow ones (refused by a timeout) ``slow_repeats`` times; ``current`` holds the name in
    flight; ``out`` gets {name: [(status, seconds), ...]}.

    At ``SCHED_IDLE`` (runs only when no service process wants the CPU; the scheduler preempts it
    at once) with one HTTP client for all its sends: on this 2-core machine the attacker's own CPU
    (building bodies, base64, a new client per send) is taken from the services under test, and a
    real attacker's is not. What the services spend refusing it stays at their own priority; the
    attacks still go back to back (``attack_sends_per_s`` in the JSON says how fast)."""
    from llm_svc.engine.grammar_worker import yield_cpu

    yield_cpu()
    freeze_startup_heap("the attacker")

    async def go() -> dict:
        sent: dict[str, list[tuple[int, float]]] = {}
        async with httpx.AsyncClient(timeout=120) as client:
            ctx.client = client
            await _send_all(sent)
        return sent

    async def _send_all(sent: dict) -> None:
        for k in range(repeats):
            for name in names:
                if k >= slow_repeats and ATTACKS[name].slow:
                    continue
                current.value = name.encode()
                a0 = time.perf_counter()
                code = await ATTACKS[name].send(ctx)
                sent.setdefault(name, []).append((code, time.perf_counter() - a0))
                current.value = b""

    out.put(asyncio.run(go()))


async def one_run(ctx: AttackContext, clients: int, max_tokens: int, seconds: float, attacks: list[str] | None,
                  repeats: int, slow_repeats: int = 1) -> dict:
    """One run: the steady load for ``seconds`` (quiet), or until every attack was sent ``repeats``
    times (the slow ones ``slow_repeats`` times; at least ``seconds``)."""
    mp = multiprocessing.get_context("spawn")
    current, out = mp.Array("c", 64), mp.Queue()
    stop = asyncio.Event()
    steady = asyncio.ensure_future(_steady(ctx.gateway, ctx.model, clients, max_tokens, stop))
    health_stop, health_out = mp.Event(), mp.Queue()
    health = mp.Process(target=_healthz, args=({"gateway": ctx.gateway, "llm": ctx.llm}, health_stop, current,
                                               health_out), daemon=True)
    health.start()
    t0 = time.monotonic()
    sent: dict[str, list[tuple[int, float]]] = {}
    await asyncio.sleep(min(2.0, seconds / 4))  # the load reaches its steady state first
    attack_s = 0.0
    if attacks:
        proc = mp.Process(target=_attacker, args=(ctx, attacks, repeats, slow_repeats, current, out), daemon=True)
        a0 = time.monotonic()
        proc.start()
        while proc.is_alive() and out.empty():
            await asyncio.sleep(0.2)
        sent = out.get(timeout=30)
        attack_s = time.monotonic() - a0
        proc.join(timeout=30)
    await asyncio.sleep(max(0.0, seconds - (time.monotonic() - t0)))
    stop.set()
    health_stop.set()
    load = await steady
    worst = await asyncio.to_thread(health_out.get, timeout=30)
    health.join(timeout=30)
    return {"wall_s": time.monotonic() - t0, "ttft_p99": percentile(load["ttft"], 99), "itl_p99": percentile(load["itl"], 99), "requests": len(load["ttft"]),
            "errors": len(load["errors"]), "max_healthz_ms": max(ms for ms, _ in worst.values()),
            "healthz": {name: {"max_ms": ms, "during": during} for name, (ms, during) in worst.items()},
            "attacks": sent, "attack_s": attack_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    _results.add_mode_args(ap)
    ap.add_argument("--runs", type=int, default=None, help="runs per side (default 3; quick 2; smoke 1)")
    ap.add_argument("--repeats", type=int, default=None, help="sends of each attack per attack run (default 20)")
    ap.add_argument("--slow-repeats", type=int, default=None,
                    help="sends per attack run of the attacks refused by a timeout (the hostile schema: 10 CPU-s of "
                    "compile each, by design); default 2; quick and smoke 1")
    ap.add_argument("--clients", type=int, default=4, help="concurrent streaming chats of the steady load")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=None, help="shortest run (default 20; quick 10; smoke 4)")
    ap.add_argument("--attacks", default=",".join(ATTACKS), help="comma-separated subset of " + ",".join(ATTACKS))
    args = ap.parse_args()
    mode = _results.mode_of(args)
    runs = args.runs or {"full": 3, "quick": 2, "smoke": 1}[mode]
    repeats = args.repeats or {"full": 20, "quick": 4, "smoke": 1}[mode]
    slow_repeats = min(repeats, args.slow_repeats or {"full": 2, "quick": 1, "smoke": 1}[mode])
    seconds = args.seconds or {"full": 20.0, "quick": 10.0, "smoke": 4.0}[mode]
    names = [n for n in args.attacks.split(",") if n]
    skipped = []
    if mode == "smoke":  # the cheap attacks only: the media ones build a video with ffmpeg first, and
        # a slow one is refused at its compile's CPU limit, at a quarter of a core: minutes on a busy machine
        skipped = [f"{n} (smoke: media attacks take ffmpeg time)" for n in names if ATTACKS[n].prepare is not None]
        skipped += [f"{n} (smoke: refused only at its compile's CPU limit, minutes under load)" for n in names
                    if ATTACKS[n].slow and ATTACKS[n].prepare is None]
        names = [n for n in names if ATTACKS[n].prepare is None and not ATTACKS[n].slow]
    unknown = sorted(set(names) - set(ATTACKS))
    if unknown:
        ap.error(f"unknown attacks {unknown}; choose from {sorted(ATTACKS)}")

    work = Path(tempfile.mkdtemp(prefix="mmserve-security-"))
    model = str(write_tiny_model(work / "tiny-omni", arch="mimo-v2.5-omni"))
    redis_url = AttackContext.redis_if_up()
    env = {"MMSERVE_ENCODER_SERVICE_TOKEN": SERVICE_TOKEN, "MMSERVE_LLM_SERVICE_TOKEN": SERVICE_TOKEN,
           "MMSERVE_GATEWAY_SERVICE_TOKEN": SERVICE_TOKEN, "MMSERVE_ENCODER_PEER_KEY": PEER_KEY,
           "MMSERVE_LLM_PEER_KEY": PEER_KEY, "MMSERVE_GATEWAY_PEER_KEY": PEER_KEY}
    spec = StackSpec(model_dir=model, gateway_port=0, api_keys=(API_KEY,), redis_url=redis_url, extra_env=env)
    stack = LocalStack(spec, log_dir=work / "logs")
    figures: dict = {}
    with stack:
        stack.wait_ready(timeout=300)
        ctx = AttackContext(gateway=stack.url, llm=stack.llms[0].url, encoder=stack.encoders[0].url,
                            model=stack.model_name, api_key=API_KEY, service_token=SERVICE_TOKEN,
                            redis_url=redis_url, work=work)
        ctx.prepare(names)
        freeze_startup_heap("the load generator")  # its full collections paused the steady load's clock ~100 ms
        # warm-up, not counted: the first chats of a fresh stack build kernels and caches
        asyncio.run(one_run(ctx, args.clients, args.max_tokens, min(seconds, 5.0), None, 0))
        quiet, attacked = [], []
        for k in range(runs):
            for side in (("attack", "quiet") if k % 2 == 0 else ("quiet", "attack")):
                # a quiet run lasts as long as the attack runs so far: each side's p99 then stands on
                # as many chats (a 10 s quiet run's p99 was its 3rd-slowest chat; an attack run lasts
                # ~90 s with the hostile schema)
                secs = seconds if side == "attack" else max(seconds, statistics.mean(r["wall_s"] for r in attacked))
                r = asyncio.run(one_run(ctx, args.clients, args.max_tokens, secs,
                                        names if side == "attack" else None, repeats, slow_repeats))
                (attacked if side == "attack" else quiet).append(r)
                print(f"run {k} {side} ({r['wall_s']:.0f} s): TTFT p99 {r['ttft_p99']}, ITL p99 {r['itl_p99']}, {r['requests']} chats, "
                      f"{r['errors']} errors, slowest /healthz {r['healthz']}", flush=True)
        ctx.cleanup()
    figures = summarize(quiet, attacked, names)
    for name, a in figures["attacks"].items():
        print(f"{name:>24}: {a['codes']}  median {a['median_ms']} ms, max {a['max_ms']} ms", flush=True)
    summary = (f"{len(names)} attacks x {repeats} (slow ones x {slow_repeats}) under a {args.clients}-chat load: p99 "
               f"{figures['max_p99_ratio']}x quiet (target <= 1.2), slowest /healthz {figures['max_healthz_ms']} ms "
               "(target <= 100)")
    _results.record("security_load", ap, args, figures, kind="wall-clock", summary=summary,
                    baseline="the same stack and steady load with no attack (quiet runs, alternated)", skipped=skipped)
    return 0


def summarize(quiet: list[dict], attacked: list[dict], names: list[str]) -> dict:
    """Pooled over runs: the median of each side's per-run p99, their ratios, each attack's codes."""
    def med(runs, key):
        vals = [r[key] for r in runs if r[key] is not None]
        return statistics.median(vals) if vals else None

    ratios = {}
    for key in ("ttft_p99", "itl_p99"):
        q, a = med(quiet, key), med(attacked, key)
        ratios[key] = round(a / q, 3) if q and a else None
    per_attack = {}
    for name in names:
        sends = [s for r in attacked for s in r["attacks"].get(name, [])]
        codes: dict[str, int] = {}
        for code, _ in sends:
            codes[str(code)] = codes.get(str(code), 0) + 1
        times = [t * 1000 for _, t in sends]
        per_attack[name] = {"codes": codes, "expected": sorted(ATTACKS[name].expected),
                            "refused": all(c in ATTACKS[name].expected for c, _ in sends) and bool(sends),
                            "median_ms": round(statistics.median(times), 1) if times else None,
                            "max_ms": round(max(times), 1) if times else None}
    return {
        "quiet_ttft_p99_s": med(quiet, "ttft_p99"), "attack_ttft_p99_s": med(attacked, "ttft_p99"),
        "quiet_itl_p99_s": med(quiet, "itl_p99"), "attack_itl_p99_s": med(attacked, "itl_p99"),
        "ttft_p99_ratio": ratios["ttft_p99"], "itl_p99_ratio": ratios["itl_p99"],
        "max_p99_ratio": max((v for v in ratios.values() if v is not None), default=None),
        "max_healthz_ms": max(r["max_healthz_ms"] for r in quiet + attacked),
        "slowest_healthz": max((dict(h, service=name) for r in attacked for name, h in r["healthz"].items()),
                               key=lambda h: h["max_ms"]),
        "quiet_healthz_ms": max(r["max_healthz_ms"] for r in quiet),
        "steady_errors": sum(r["errors"] for r in quiet + attacked),
        "all_refused": all(a["refused"] for a in per_attack.values()),
        # how hard the attacks came: sends per second of attack run, slow and fast together
        "attack_sends_per_s": round(sum(len(v) for r in attacked for v in r["attacks"].values())
                                    / max(1e-9, sum(r.get("attack_s", 0.0) for r in attacked)), 2),
        "attacks": per_attack,
    }


if __name__ == "__main__":
    _results.run(main)
