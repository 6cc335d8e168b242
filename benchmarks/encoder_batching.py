"""Images/s at concurrency 16: cross-request batching vs ``max_batch_size=1``, same run, cache off.

Wall-clock. Both servers run the same random SigLIP bundle (see ``_enc_bundle``: ``--tower small``,
24 narrow layers where per-op overhead dominates, or ``--tower so400m``, SigLIP-so400m's
geometry at 112 px, where the matmuls do; or ``--tower mimo-omni``, the MiMo-V2.5 ViT in a whole
omni checkpoint, 96 px images = 9 tokens each) in their own
process; rounds alternate between them so machine load affects both alike; the median round
counts. Last line: JSON.

    python -m benchmarks.encoder_batching [--quick] [--tower small|so400m|mimo-omni]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics

from benchmarks import _results
from benchmarks._chat_load import drive, http_client
from benchmarks._enc_bundle import TOWERS, bench_bundle, random_images
from benchmarks._enc_server import forward_passes, spawn_encoder


async def one_round(url: str, images: list[bytes], concurrency: int) -> float:
    """Images/s of one round: every image encoded, ``concurrency`` in flight
    (``benchmarks._chat_load.drive``)."""
    async with http_client(url, timeout=300, max_connections=concurrency) as c:
        async def one(i: int) -> None:
            r = await c.post("/v1/encode", params={"modality": "image"}, content=images[i])
            r.raise_for_status()

        _, wall = await drive(len(images), one, concurrency)
        return len(images) / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=0, help="per round (default 48 quick / 160 full)")
    ap.add_argument("--rounds", type=int, default=0, help="default 3 quick / 5 full")
    ap.add_argument("--tower", default="small", choices=sorted(TOWERS))
    ap.add_argument("--max-wait-ms", type=float, default=10.0, help="batching window (both servers)")
    _results.add_mode_args(ap)
    args = ap.parse_args()
    if args.smoke:
        args.requests, args.rounds, args.concurrency = 4, 1, 4
    big = args.tower != "small"
    n = args.requests or ((16 if big else 48) if args.quick else (48 if big else 160))
    rounds = args.rounds or (2 if big and args.quick else 3 if args.quick else 5)
    bundle = bench_bundle(args.tower)
    images = random_images(n * rounds, seed=1)
    common = dict(model_dir=bundle, cache_bytes=0, max_wait_ms=args.max_wait_ms)
    results: dict[str, list[float]] = {"batched": [], "unbatched": []}
    passes: dict[str, float] = {}
    with spawn_encoder(max_batch_size=16, **common) as b, spawn_encoder(max_batch_size=1, **common) as u:
        urls = {"batched": b, "unbatched": u}
        for name, url in urls.items():  # warm-up
            asyncio.run(one_round(url, images[:8], args.concurrency))
            passes[name] = -forward_passes(url)
        for r in range(rounds):
            batch = images[r * n : (r + 1) * n]
            for name in ("batched", "unbatched") if r % 2 == 0 else ("unbatched", "batched"):
                results[name].append(asyncio.run(one_round(urls[name], batch, args.concurrency)))
                print(f"round {r} {name:9s} {results[name][-1]:7.1f} images/s", flush=True)
        for name, url in urls.items():
            passes[name] += forward_passes(url)
    med = {k: statistics.median(v) for k, v in results.items()}
    speedup = med["batched"] / med["unbatched"]
    avg_batch = n * rounds / max(passes["batched"], 1)
    print(f"\nconcurrency {args.concurrency}, {n} images x {rounds} rounds, cores {os.cpu_count()}, tower {args.tower} {TOWERS[args.tower][1]}")
    print(f"{'':10s} {'images/s (median)':>18s} {'forwards':>9s} {'images/forward':>15s}")
    for k in ("batched", "unbatched"):
        print(f"{k:10s} {med[k]:18.1f} {passes[k]:9.0f} {n * rounds / max(passes[k], 1):15.2f}")
    print(f"speedup {speedup:.2f}x (target >= 2x)")
    figures = {
        "tower": args.tower, "quick": args.quick, "cores": os.cpu_count(),
        "concurrency": args.concurrency, "requests_per_round": n, "rounds": rounds, "max_wait_ms": args.max_wait_ms,
        "batched_images_per_s": round(med["batched"], 2), "unbatched_images_per_s": round(med["unbatched"], 2),
        "speedup": round(speedup, 3), "avg_batch_size": round(avg_batch, 2), "target_speedup": 2.0,
        "meets_target": speedup >= 2.0,
    }
    _results.record("encoder_batching", ap, args, figures, kind="wall-clock", baseline="batch size 1 (cache off)",
                    summary=f"{args.tower} {speedup:.2f}x ({med['batched']:.2f} vs {med['unbatched']:.2f} images/s, "
                            f"{avg_batch:.1f} images/forward)")


if __name__ == "__main__":
    _results.run(main)
