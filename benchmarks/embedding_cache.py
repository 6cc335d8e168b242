"""Embedding cache: repeated-image (hit) vs cold encode latency, and a Zipf workload's hit
ratio and throughput with the cache vs without, in one run. Last line: JSON.

Servers run the larger random SigLIP bundle (``_enc_bundle``) in subprocesses; the client
sends sequential requests (latency) and a concurrency-4 Zipf(s) stream over distinct images.

    python -m benchmarks.embedding_cache [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import httpx
import numpy as np

from benchmarks import _results
from benchmarks._chat_load import drive, http_client
from benchmarks._enc_bundle import bench_bundle, random_images
from benchmarks._enc_server import forward_passes, spawn_encoder
from benchmarks._stats import percentile
from shared.schemas import EncodeResult
from shared.wire import unpack


async def timed_encode(c: httpx.AsyncClient, body: bytes) -> tuple[float, bool]:
    """(seconds from send to the whole answer read, whether the encoder answered from its cache)."""
    t = time.perf_counter()
    r = await c.post("/v1/encode", params={"modality": "image"}, content=body)
    dt = time.perf_counter() - t
    r.raise_for_status()
    return dt, unpack(r.content, EncodeResult)[1].cached


async def cold_and_hit(url: str, cold_imgs: list[bytes], repeated: bytes,
                       blocks: int = 4) -> tuple[list[float], list[float], float]:
    """Blocks of never-seen images (misses) alternating with blocks of one repeated image
    (hits), one request at a time on one keep-alive connection (``benchmarks._chat_load.drive``
    at concurrency 1); returns cold and hit latencies and the forwards the hits ran."""
    cold, hit, hit_forwards = [], [], 0.0
    per = max(1, len(cold_imgs) // blocks)
    async with http_client(url, timeout=120, max_connections=1) as c:
        await timed_encode(c, repeated)  # cached from now on; warms the connection
        for k in range(0, len(cold_imgs), per):
            block = cold_imgs[k : k + per]
            recs, _ = await drive(len(block), lambda i: timed_encode(c, block[i]), concurrency=1)
            assert not any(was_cached for _, was_cached in recs)
            cold += [t for t, _ in recs]
            f0 = forward_passes(url)
            recs, _ = await drive(per, lambda i: timed_encode(c, repeated), concurrency=1)
            assert all(was_cached for _, was_cached in recs)
            hit += [t for t, _ in recs]
            hit_forwards += forward_passes(url) - f0
    return cold, hit, hit_forwards


async def stream(url: str, bodies: list[bytes], concurrency: int) -> tuple[float, int]:
    """(requests/s, cache hits) of ``bodies`` sent ``concurrency`` at a time."""
    async with http_client(url, timeout=300) as c:
        async def one(i: int) -> bool:
            r = await c.post("/v1/encode", params={"modality": "image"}, content=bodies[i])
            r.raise_for_status()
            return unpack(r.content, EncodeResult)[1].cached

        cached, wall = await drive(len(bodies), one, concurrency)
        return len(bodies) / wall, sum(cached)


def zipf_workload(n_items: int, n_requests: int, s: float, seed: int) -> list[int]:
    p = 1.0 / np.arange(1, n_items + 1) ** s
    return np.random.default_rng(seed).choice(n_items, size=n_requests, p=p / p.sum()).tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--zipf-s", type=float, default=1.1)
    _results.add_mode_args(ap)
    args = ap.parse_args()
    n_lat = 2 if args.smoke else 20 if args.quick else 60
    n_items, n_req = (4, 8) if args.smoke else (100, 200) if args.quick else (400, 1000)
    bundle = bench_bundle("small")
    cold_imgs = random_images(n_lat, seed=10)
    zipf_imgs = random_images(n_items, seed=20)
    order = zipf_workload(n_items, n_req, args.zipf_s, seed=0)
    common = dict(model_dir=bundle, max_batch_size=16, max_wait_ms=5.0)
    with spawn_encoder(cache_bytes=256 << 20, **common) as cached_url, spawn_encoder(cache_bytes=0, **common) as plain_url:
        cold, hit, hit_forwards = asyncio.run(cold_and_hit(cached_url, cold_imgs, random_images(1, seed=11)[0]))
        assert hit_forwards == 0
        bodies = [zipf_imgs[i] for i in order]
        rate_plain, _ = asyncio.run(stream(plain_url, bodies, 4))
        rate_cached, hits = asyncio.run(stream(cached_url, bodies, 4))
    cold_ms, hit_ms = percentile(cold, 50) * 1e3, percentile(hit, 50) * 1e3
    speedup = cold_ms / hit_ms
    ideal_hit_ratio = 1 - len(set(order)) / n_req
    print(f"cold encode   median {cold_ms:7.2f} ms   (p90 {percentile(cold, 90) * 1e3:.2f})")
    print(f"cache hit     median {hit_ms:7.2f} ms   (p90 {percentile(hit, 90) * 1e3:.2f}), "
          f"forwards on hits: {hit_forwards:.0f}")
    print(f"hit speedup   {speedup:.1f}x (target >= 10x)")
    print(f"zipf s={args.zipf_s}: {n_req} requests over {n_items} images, concurrency 4")
    print(f"  hit ratio {hits / n_req:.3f} (upper bound with an unbounded cache {ideal_hit_ratio:.3f})")
    print(f"  throughput cache on {rate_cached:.1f} req/s vs cache off {rate_plain:.1f} req/s "
          f"({rate_cached / rate_plain:.2f}x)")
    figures = {
        "quick": args.quick, "cores": os.cpu_count(),
        "cold_ms_median": round(cold_ms, 3), "hit_ms_median": round(hit_ms, 3), "hit_speedup": round(speedup, 2),
        "zipf_s": args.zipf_s, "zipf_requests": n_req, "zipf_items": n_items,
        "zipf_hit_ratio": round(hits / n_req, 4), "zipf_hit_ratio_bound": round(ideal_hit_ratio, 4),
        "zipf_req_per_s_cache": round(rate_cached, 2), "zipf_req_per_s_nocache": round(rate_plain, 2),
        "target_hit_speedup": 10.0, "meets_target": speedup >= 10.0,
    }
    _results.record("embedding_cache", ap, args, figures, kind="wall-clock", baseline="cold encode (cache off)",
                    summary=f"hit {speedup:.0f}x faster; {hits / n_req:.2f} hit ratio")


if __name__ == "__main__":
    _results.run(main)
