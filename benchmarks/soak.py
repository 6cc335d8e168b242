"""Soak: a bounded run of mixed traffic (text and small-image chats, streamed and not, from
``--clients`` closed-loop clients) against ``mmserve``'s local stack (1 encoder, 1 ``swa`` LLM,
gateway), sampling the RSS of every service (the LLM with its engine core) over time.

Reported per service: the RSS series, and the growth after warm-up (the first third of the run)
as the least-squares slope, in % per 30 minutes. Target (issue 11): < 1% per 30 min. There is
no baseline side: a soak measures our own services' memory over time. The last line is JSON.

    python -m benchmarks.soak --quick       # 3 minutes
    python -m benchmarks.soak               # 30 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks._stack_util import image_part, make_png, user
from benchmarks.overload import rss_mb
from shared.launcher import LocalStack, StackSpec
from shared.tiny_model import write_tiny_model


def slope_pct_per_30min(ts: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ``ys`` over ``ts`` (s), as % of the mean per 30 minutes."""
    n = len(ts)
    if n < 3:
        return None
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    if var == 0 or my == 0:
        return None
    slope = sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var  # MB per s
    return round(100.0 * slope * 1800.0 / my, 3)


async def clients(url: str, model: str, n: int, stop_at: float, counts: dict) -> None:
    async def one(c: httpx.AsyncClient, k: int) -> None:
        rng, i = random.Random(k), k
        while time.monotonic() < stop_at:
            words = " ".join(rng.choice(["red", "blue", "cat", "dog", "sky", "sea"]) for _ in range(rng.randint(5, 50)))
            parts = [image_part(make_png(seed=i % 64))] if i % 3 == 0 else []
            body = {"model": model, "max_tokens": rng.randint(4, 24), "stream": i % 2 == 1,
                    "messages": [user(f"{i} {words}", *parts)]}
            try:
                r = await c.post(url, json=body)
                counts["ok" if r.status_code == 200 else str(r.status_code)] = counts.get(
                    "ok" if r.status_code == 200 else str(r.status_code), 0) + 1
            except httpx.HTTPError as e:
                counts[type(e).__name__] = counts.get(type(e).__name__, 0) + 1
            i += n

    async with httpx.AsyncClient(timeout=120) as c:
        await asyncio.gather(*(one(c, k) for k in range(n)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--minutes", type=float, default=None)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--interval", type=float, default=None, help="seconds between RSS samples")
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    minutes = args.minutes or (3.0 if args.quick else 30.0)
    interval = args.interval or (5.0 if args.quick else 30.0)
    log_dir = Path(tempfile.mkdtemp(prefix="mmserve-soak-"))
    model = args.model or str(write_tiny_model(log_dir / "tiny-mimo", arch="mimo"))
    out: dict = {"bench": "soak", "quick": args.quick, "minutes": minutes, "clients": args.clients,
                 "note": "no baseline side: our services' RSS over time", "series": []}
    with LocalStack(StackSpec(model_dir=model, gateway_port=0), log_dir=log_dir) as stack:
        stack.wait_ready(timeout=300)
        pids = {s.name: s.proc.pid for s in stack.services}
        counts: dict = {}
        t0 = time.monotonic()
        stop_at = t0 + minutes * 60
        load = threading.Thread(target=lambda: asyncio.run(
            clients(f"{stack.url}/v1/chat/completions", stack.model_name, args.clients, stop_at, counts)))
        load.start()
        while time.monotonic() < stop_at:
            out["series"].append({"t": round(time.monotonic() - t0, 1), "requests": counts.get("ok", 0),
                                  **{name: rss_mb(pid) for name, pid in pids.items()}})
            print(out["series"][-1], flush=True)
            time.sleep(interval)
        load.join()
        out["counts"] = counts
    warm = [p for p in out["series"] if p["t"] >= minutes * 20]  # after the first third
    out["growth_pct_per_30min_after_warmup"] = {
        name: slope_pct_per_30min([p["t"] for p in warm], [p[name] for p in warm]) for name in pids
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
