"""Chunked parallel video decode vs the best single reader a user would otherwise run.

Wall-clock. A 5 min 720p 30 fps H.264 clip (ffmpeg testsrc, 2 s GOP, written once into the
bench cache, outside the repo) sampled uniformly (64 frames; 256 too unless --quick).
Baselines, each one reader asked for all indices:

* ``decord default``: ``decord.VideoReader(num_threads=0)``, the library's default (auto threads);
* ``torchcodec default``: ``VideoDecoder(...)`` as constructed by default (``num_ffmpeg_threads=1``);
* ``torchcodec auto``: ``num_ffmpeg_threads=0`` (FFmpeg picks the thread count);
* ``<backend> 1-thread``: the reader the service uses per chunk (one decode thread), reported too.

The *best* of these for each frame count is the headline baseline. "chunked" is
``ChunkedVideoDecoder`` (one single-threaded reader per chunk, a thread pool of W workers),
reported for W = 1, 2, 4, ... up to the cores. Sides alternate within each repeat; medians.
Every output is checked equal to the 1-thread reader's. Last line JSON.

    python -m benchmarks.video_decode [--quick] [--seconds 300]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import time
from typing import Callable

import torch

from benchmarks import _results
from benchmarks._enc_bundle import CACHE_DIR
from encoder_svc.video.backends import VIDEO_BACKENDS
from encoder_svc.video.decode import ChunkedVideoDecoder, decode_sequential
from encoder_svc.video.sampling import sample_indices

TARGET = 1.3  # chunked at the cores' worker count over the best single reader


def bench_video(seconds: int = 300) -> bytes:
    path = CACHE_DIR / f"testsrc_720p_{seconds}s_h264.mp4"
    if not path.exists():
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.mp4")
        subprocess.run(
            ["ffmpeg", "-loglevel", "error", "-y", "-f", "lavfi", "-i", "testsrc=size=1280x720:rate=30",
             "-t", str(seconds), "-c:v", "libx264", "-preset", "veryfast", "-g", "60", "-pix_fmt", "yuv420p",
             str(tmp)],
            check=True,
        )
        tmp.rename(path)
    return path.read_bytes()


def _spin(n: int = 4_000_000) -> int:
    s = 0
    for i in range(n):
        s += i
    return s


def parallel_capacity(workers: int) -> float:
    """How many cores this run actually gets: time of one CPU-bound task x workers over the
    time of ``workers`` such tasks in parallel processes (= workers on an idle machine)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    t = time.perf_counter()
    _spin()
    one = time.perf_counter() - t
    procs = [ctx.Process(target=_spin) for _ in range(workers)]
    t = time.perf_counter()
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return one * workers / (time.perf_counter() - t)


def single_readers(data: bytes) -> dict[str, Callable[[list[int]], torch.Tensor]]:
    """The single-reader baselines (name -> decode all indices with one fresh reader)."""
    import decord
    from torchcodec.decoders import VideoDecoder

    def decord_default(idx):
        vr = decord.VideoReader(io.BytesIO(data))  # num_threads=0: decord's default
        return torch.from_numpy(vr.get_batch(idx).asnumpy()).permute(0, 3, 1, 2)

    def torchcodec_with(threads: int | None):
        def run(idx):
            kw = {} if threads is None else {"num_ffmpeg_threads": threads}
            return VideoDecoder(data, dimension_order="NCHW", seek_mode="exact", **kw).get_frames_at(idx).data
        return run

    out = {"decord default": decord_default, "torchcodec default": torchcodec_with(None),
           "torchcodec auto": torchcodec_with(0)}
    for backend in sorted(VIDEO_BACKENDS):
        out[f"{backend} 1-thread"] = lambda idx, b=backend: decode_sequential(b, data, idx)
    return out


def timed_round_robin(fns: dict[str, Callable[[], torch.Tensor]], repeats: int) -> tuple[dict[str, float], dict]:
    """Median time of each fn; the order rotates every repeat, so load changes hit all alike."""
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    outs = {}
    for r in range(repeats):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            t = time.perf_counter()
            outs[n] = fns[n]()
            times[n].append(time.perf_counter() - t)
    return {n: statistics.median(v) for n, v in times.items()}, outs


def worker_counts(cores: int, explicit: int) -> list[int]:
    if explicit:
        return [explicit]
    ws, w = [], 1
    while w < cores:
        ws.append(w)
        w *= 2
    return ws + [cores]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=0, help="default 2 quick / 5 full")
    ap.add_argument("--workers", type=int, default=0, help="only this chunk-reader count (default 1, 2, 4.. cores)")
    ap.add_argument("--seconds", type=int, default=300, help="video length (>= 300 for the README figure)")
    _results.add_mode_args(ap)
    args = ap.parse_args()
    if args.smoke:  # every reader and chunked decoder once, on a 4 s clip
        args.seconds, args.repeats = 4, 1
    repeats = args.repeats or (2 if args.quick else 5)
    data = bench_video(args.seconds)
    cores = os.cpu_count() or 1
    workers = worker_counts(cores, args.workers)
    frame_counts = (8,) if args.smoke else (64,) if args.quick else (64, 256)
    capacity = [parallel_capacity(cores)]
    singles = single_readers(data)
    decoders = {(b, w): ChunkedVideoDecoder(b, workers=w) for b in sorted(VIDEO_BACKENDS) for w in workers}
    info = decoders[(sorted(VIDEO_BACKENDS)[0], workers[0])].probe(data)
    results = {}
    for frames in frame_counts:
        idx = sample_indices(info.num_frames, info.fps, frames / (info.num_frames / info.fps), frames)
        assert len(idx) == frames, len(idx)
        fns = {n: (lambda f=f: f(idx)) for n, f in singles.items()}
        fns.update({f"chunked {b} W={w}": (lambda d=d: d.decode(data, idx)) for (b, w), d in decoders.items()})
        for f in fns.values():
            f()  # warm-up (page cache, codec init)
        med, outs = timed_round_robin(fns, repeats)
        ref = outs["decord 1-thread"]
        for n, o in outs.items():
            assert torch.equal(o, ref), f"{n}: frames differ from the 1-thread decord reader's"
        best_single = min((n for n in singles), key=lambda n: med[n])
        full = f"chunked {{}} W={cores if not args.workers else args.workers}"
        best_chunked = min((full.format(b) for b in VIDEO_BACKENDS), key=lambda n: med[n])
        speedup = med[best_single] / med[best_chunked]
        results[str(frames)] = {
            "seconds": {n: round(v, 3) for n, v in med.items()},
            "best_single": best_single, "best_chunked": best_chunked,
            "speedup_vs_best_single": round(speedup, 3),
            "speedup_vs_1thread": {b: round(med[f"{b} 1-thread"] / med[full.format(b)], 3) for b in VIDEO_BACKENDS},
        }
        print(f"\n{frames} frames from {info.num_frames / info.fps:.0f} s {info.width}x{info.height}, median of {repeats}:")
        print(f"  {'decode':28s} {'time':>8s}  vs best single")
        for n in sorted(med, key=lambda n: (n.startswith("chunked"), n)):
            print(f"  {n:28s} {med[n]:7.2f}s  {med[best_single] / med[n]:5.2f}x")
        print(f"  best single reader: {best_single}; best chunked at W={cores}: {best_chunked}: {speedup:.2f}x "
              f"(target >= {TARGET}x)", flush=True)
    for d in decoders.values():
        d.close()
    capacity.append(parallel_capacity(cores))
    load = os.getloadavg()[0]
    print(f"\nload average {load:.1f}; parallel capacity measured before/after: "
          f"{capacity[0]:.2f}x / {capacity[1]:.2f}x of {cores} (the ceiling for any speedup here)")
    head = results[str(frame_counts[0])]
    figures = {
        "cores": cores, "workers": workers, "quick": args.quick,
        "video": f"{info.width}x{info.height} {info.num_frames / info.fps:.0f}s h264", "repeats": repeats,
        "load_avg_1m": round(load, 2), "parallel_capacity": [round(c, 2) for c in capacity], "results": results,
        f"speedup_{frame_counts[0]}_vs_best_single": head["speedup_vs_best_single"], "target": TARGET,
        "meets_target": head["speedup_vs_best_single"] >= TARGET,
    }  # fmt: skip
    secs, speedup = head["seconds"], head["speedup_vs_best_single"]
    summary = (f"{speedup:.2f}x the best single reader ({head['best_single']}, {secs[head['best_single']]:.2f} s; "
               f"{head['best_chunked']} {secs[head['best_chunked']]:.2f} s), {frame_counts[0]} frames; target {TARGET}x "
               f"{'met' if speedup >= TARGET else '**not met**'}; load average {load:.1f}, parallel capacity "
               f"{min(capacity):.2f}-{max(capacity):.2f} of {cores} cores")
    _results.record("video_decode", ap, args, figures, kind="wall-clock", summary=summary,
                    baseline="the best single reader (decord / torchcodec, library-default threading)")


if __name__ == "__main__":
    _results.run(main)
