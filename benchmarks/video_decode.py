"""Chunked parallel video decode vs one sequential reader, per backend, 64 and 256 frames.

A 60 s 720p 30 fps H.264 clip (ffmpeg testsrc, 2 s GOP, written once into the bench cache) is
sampled uniformly; "sequential" is one reader with one decode thread asked for all indices,
"chunked" is ``ChunkedVideoDecoder`` (one single-threaded reader per chunk, a thread pool
sized to the cores). Both outputs are checked identical. Median of repeats; last line JSON.

    python -m benchmarks.video_decode [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

import torch

from benchmarks._enc_bundle import CACHE_DIR
from encoder_svc.video.backends import VIDEO_BACKENDS
from encoder_svc.video.decode import ChunkedVideoDecoder, decode_sequential
from encoder_svc.video.sampling import sample_indices


def bench_video(seconds: int = 60) -> bytes:
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


def timed_pair(seq_fn, par_fn, repeats: int) -> tuple[float, float, torch.Tensor, torch.Tensor]:
    """Median times of both, alternating which runs first, so load changes hit both alike."""
    t_seq, t_par, seq, par = [], [], None, None
    for r in range(repeats):
        for which in (("seq", "par") if r % 2 == 0 else ("par", "seq")):
            t = time.perf_counter()
            if which == "seq":
                seq = seq_fn()
                t_seq.append(time.perf_counter() - t)
            else:
                par = par_fn()
                t_par.append(time.perf_counter() - t)
    return statistics.median(t_seq), statistics.median(t_par), seq, par


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=0, help="default 2 quick / 5 full")
    ap.add_argument("--workers", type=int, default=0, help="chunk readers; 0 = cores")
    args = ap.parse_args()
    repeats = args.repeats or (2 if args.quick else 5)
    data = bench_video()
    cores = os.cpu_count() or 1
    rows, results = [], {}
    capacity = [parallel_capacity(args.workers or cores)]
    for backend in sorted(VIDEO_BACKENDS):
        dec = ChunkedVideoDecoder(backend, workers=args.workers)
        info = dec.probe(data)
        for frames in (64, 256):
            idx = sample_indices(info.num_frames, info.fps, frames / (info.num_frames / info.fps), frames)
            assert len(idx) == frames, len(idx)
            dec.decode(data, idx[:4])  # warm-up (page cache, codec init)
            t_seq, t_par, seq, par = timed_pair(
                lambda: decode_sequential(backend, data, idx), lambda: dec.decode(data, idx), repeats
            )
            assert torch.equal(seq, par), "chunked frames differ from the sequential reader's"
            speedup = t_seq / t_par
            rows.append((backend, frames, t_seq, t_par, speedup))
            results[f"{backend}_{frames}"] = {"sequential_s": round(t_seq, 3), "chunked_s": round(t_par, 3),
                                              "speedup": round(speedup, 3)}
            print(f"{backend:10s} {frames:4d} frames  sequential {t_seq:6.2f} s  chunked {t_par:6.2f} s  "
                  f"{speedup:5.2f}x", flush=True)
        dec.close()
    capacity.append(parallel_capacity(args.workers or cores))
    load = os.getloadavg()[0]
    print(f"\nload average {load:.1f}; parallel capacity measured before/after: "
          f"{capacity[0]:.2f}x / {capacity[1]:.2f}x of {args.workers or cores} (the ceiling for any speedup here)")
    print(f"video {info.width}x{info.height} {info.num_frames} frames @ {info.fps:g} fps, cores {cores}, "
          f"workers {args.workers or cores}, median of {repeats}")
    best64 = max(r[4] for r in rows if r[1] == 64)
    default64 = results["decord_64"]["speedup"]
    print(f"decord 64 frames: {default64:.2f}x (target >= 1.7x)")
    print(json.dumps({
        "benchmark": "video_decode", "quick": args.quick, "cores": cores, "workers": args.workers or cores,
        "video": f"{info.width}x{info.height} {info.num_frames / info.fps:.0f}s h264", "repeats": repeats, "load_avg_1m": round(load, 2),
        "parallel_capacity": [round(c, 2) for c in capacity],
        "results": results, "best_speedup_64": round(best64, 3), "target_speedup_64": 1.7,
        "meets_target": default64 >= 1.7,
    }))


if __name__ == "__main__":
    main()
