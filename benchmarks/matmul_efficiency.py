"""How much of this machine's fp32 GEMM peak the engine's matmuls reach, prefill-heavy and
decode-heavy, with the same threads on both sides of the ratio.

Peak: the best of oneDNN (packed weight) and ``F.linear`` (MKL) on one large square GEMM
(``--peak-n``, 2048), measured in this run with the engine's thread count. Engine: our engine
in-process on the ``vs_vllm`` MiMo checkpoint (``benchmarks._vs_vllm_servers.MiMoSpec``), run
under ``torch.profiler`` with shapes recorded; the matmul FLOPs of every linear op
(``mkldnn::_linear_pointwise``, ``aten::mm`` / ``addmm`` / ``linear`` / ``matmul``'s ``mm``) are
summed from their shapes and divided by those ops' own time. Calls of our packed-weight kernel
(``cpu_packed.linear`` / ``moe``, the CPU float32 default, invisible to the profiler) are timed
around each call and counted from their shapes (a MoE call: its token-expert pairs' two products). Two workloads: prefill-heavy
(``--prefill`` prompts of ``--prompt`` tokens, 1 output token each) and decode-heavy
(``--decode`` sequences of 300 tokens, then ``--steps`` decode steps measured). Decode GEMMs
have a handful of rows: they are bound by streaming the weights from memory, so their FLOP/s
are far below a compute peak by nature; the bytes/s of weights are printed beside them.

    python -m benchmarks.matmul_efficiency [--quick] [--threads N]

Wall-clock, ours only (vLLM's engine is not profiled here); the last line is JSON
(``"kind": "matmul_efficiency"``).
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from benchmarks import _results

LINEAR_OPS = {"mkldnn::_linear_pointwise", "aten::mm", "aten::addmm"}


def gemm_peak(n: int, reps: int = 5) -> dict[str, float]:
    """GFLOP/s of an n x n x n fp32 GEMM, oneDNN on a packed weight and F.linear, best of reps."""
    x, w = torch.randn(n, n), torch.randn(n, n)
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    out = {}
    for name, fn in (("onednn", lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")),
                     ("torch", lambda: F.linear(x, w))):
        fn()
        best = min(_timed(fn) for _ in range(reps))
        out[name] = round(2 * n ** 3 / best / 1e9, 1)
    return out


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def linear_stats(prof) -> dict[str, float]:
    """Matmul FLOPs, weight bytes and own time of the profiled linear ops."""
    flops = nbytes = secs = 0.0
    calls = 0
    for ev in prof.events():
        if ev.name not in LINEAR_OPS or not ev.input_shapes:
            continue
        shapes = ev.input_shapes
        if ev.name == "aten::addmm":
            shapes = shapes[1:]
        a, b = shapes[0], shapes[1]
        if len(a) < 2 or len(b) != 2:
            continue
        m = 1
        for d in a[:-1]:
            m *= d
        k = a[-1]
        n = b[0] if ev.name == "mkldnn::_linear_pointwise" else b[1]  # packed weight [N, K]; mm's [K, N]
        flops += 2.0 * m * n * k
        nbytes += 4.0 * n * k
        secs += ev.self_cpu_time_total / 1e6
        calls += 1
    return {"gflop": round(flops / 1e9, 2), "seconds": round(secs, 3), "calls": calls,
            "gflop_s": round(flops / secs / 1e9, 1) if secs else 0.0,
            "weight_gb_s": round(nbytes / secs / 1e9, 1) if secs else 0.0}


class KernelMeter:
    """Times every packed-kernel call while active (``cpu_packed.gemm`` / ``moe_w``: weights of any
    format, what the linears and experts call; ``linear`` / ``moe``: the float32 ones) and counts
    its matmul FLOPs and weight bytes (a MoE call: the experts its tokens chose)."""

    def __init__(self):
        self.flops = self.nbytes = self.secs = 0.0
        self.calls = 0

    def __enter__(self) -> "KernelMeter":
        from llm_svc.models import cpu_packed

        self._mod = cpu_packed
        self._orig = {name: getattr(cpu_packed, name) for name in ("gemm", "moe_w", "linear", "moe")}
        o = self._orig

        def gemm(x, pw, bias=None, threads=None):
            t = time.perf_counter()
            out = o["gemm"](x, pw, bias, threads)
            self._add(time.perf_counter() - t, 2.0 * (x.numel() // pw.k) * pw.n * pw.k, float(pw.nbytes))
            return out

        def moe_w(x, idx, w, pe, threads=None):
            t = time.perf_counter()
            out = o["moe_w"](x, idx, w, pe, threads)
            chosen = len(set(idx.reshape(-1).tolist()))
            self._add(time.perf_counter() - t, 2.0 * idx.numel() * 3 * pe.hidden * pe.inter,
                      pe.nbytes * chosen / pe.num_experts)
            return out

        def linear(x, packed, n, bias=None, threads=None):
            t = time.perf_counter()
            out = o["linear"](x, packed, n, bias, threads)
            self._add(time.perf_counter() - t, 2.0 * (x.numel() // packed.shape[1]) * n * packed.shape[1],
                      4.0 * n * packed.shape[1])
            return out

        def routed(x, idx, w, packed, threads=None):
            t = time.perf_counter()
            out = o["moe"](x, idx, w, packed, threads)
            gp = packed[0]
            e, i2, h = gp.shape
            self._add(time.perf_counter() - t, 2.0 * idx.numel() * (i2 * h + h * i2 // 2),
                      4.0 * len(set(idx.reshape(-1).tolist())) * (i2 * h + h * i2 // 2))
            return out

        cpu_packed.gemm, cpu_packed.moe_w, cpu_packed.linear, cpu_packed.moe = gemm, moe_w, linear, routed
        return self

    def _add(self, secs: float, flops: float, nbytes: float) -> None:
        self.secs += secs
        self.flops += flops
        self.nbytes += nbytes
        self.calls += 1

    def __exit__(self, *exc) -> None:
        for name, fn in self._orig.items():
            setattr(self._mod, name, fn)


def merged(prof_stats: dict, meter: KernelMeter) -> dict:
    flops = prof_stats["gflop"] * 1e9 + meter.flops
    secs = prof_stats["seconds"] + meter.secs
    nbytes = prof_stats["weight_gb_s"] * prof_stats["seconds"] * 1e9 + meter.nbytes
    return {"gflop": round(flops / 1e9, 2), "seconds": round(secs, 3), "calls": prof_stats["calls"] + meter.calls,
            "gflop_s": round(flops / secs / 1e9, 1) if secs else 0.0,
            "weight_gb_s": round(nbytes / secs / 1e9, 1) if secs else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on both sides (the engine's decode steps use 1)")
    ap.add_argument("--prefill", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1300)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--peak-n", type=int, default=2048)
    ap.add_argument("--linear", default="auto", help="linear backend of the engine (auto / packed / onednn / torch)")
    _results.add_mode_args(ap)
    args = ap.parse_args()
    if args.smoke:
        args.prefill, args.prompt, args.decode, args.steps, args.peak_n = 1, 64, 2, 2, 256
    elif args.quick:
        args.prefill, args.steps = 4, 24
    torch.set_num_threads(args.threads)

    from benchmarks._vs_vllm_servers import MODELS, ensure_checkpoint
    from benchmarks.engine_throughput import _Collect
    from llm_svc.core.build import build_engine
    from mmserve.testing.in_process import InProcessEngine
    from llm_svc.loading.loader import load_lm
    from llm_svc.types.request import PreparedRequest, SamplingParams
    from shared.settings import LLMSettings

    model_dir = ensure_checkpoint(MODELS["mimo"])
    lm = load_lm(str(model_dir))
    settings = LLMSettings(model_dir=str(model_dir), backend="swa", kv_bytes=512 << 20, enable_prefix_cache=False,
                           linear_backend=args.linear)
    engine = InProcessEngine(build_engine(settings, lm), lm.tokenizer)
    rng = random.Random(0)

    def submit(n: int, plen: int, out: int) -> list:
        streams = [_Collect(f"r{rng.random()}") for _ in range(n)]
        for s in streams:
            ids = [rng.randrange(20, 4000) for _ in range(plen)]
            engine.submit(PreparedRequest(s.request_id, ids, SamplingParams(max_tokens=out, ignore_eos=True)), s)
        return streams

    def drain(streams) -> None:
        while not all(s.outs and s.outs[-1].final for s in streams):
            engine.step()

    drain(submit(2, 200, 4))  # warm-up
    peak_before = gemm_peak(args.peak_n)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof, KernelMeter() as meter:
        t = time.perf_counter()
        drain(submit(args.prefill, args.prompt, 1))
        prefill_wall = time.perf_counter() - t
    prefill = {**merged(linear_stats(prof), meter), "wall_s": round(prefill_wall, 2)}
    streams = submit(args.decode, 300, args.steps + 8)
    while not all(s.outs for s in streams):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof, KernelMeter() as meter:
        t = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        decode_wall = time.perf_counter() - t
    decode = {**merged(linear_stats(prof), meter), "wall_ms_per_step": round(decode_wall / args.steps * 1e3, 2)}
    drain(streams)
    engine.scheduler.check_integrity()
    peak_after = gemm_peak(args.peak_n)
    peak = max(*peak_before.values(), *peak_after.values())
    prefill["of_peak"] = round(prefill["gflop_s"] / peak, 3)
    decode["of_peak"] = round(decode["gflop_s"] / peak, 3)

    print(f"fp32 GEMM peak, {args.threads} thread(s), n={args.peak_n}: before {peak_before}, after {peak_after} GFLOP/s")
    print(f"prefill-heavy ({args.prefill} x {args.prompt} tokens): matmuls {prefill['gflop']} GFLOP in "
          f"{prefill['seconds']} s = {prefill['gflop_s']} GFLOP/s = {prefill['of_peak']:.0%} of peak "
          f"(wall {prefill['wall_s']} s)")
    print(f"decode-heavy ({args.decode} sequences, {args.steps} steps): {decode['gflop_s']} GFLOP/s = "
          f"{decode['of_peak']:.0%} of peak; weights streamed at {decode['weight_gb_s']} GB/s "
          f"({decode['wall_ms_per_step']} ms per step)")
    figures = {"threads": args.threads, "linear": args.linear, "peak_gflop_s": peak,
               "peak_runs": [peak_before, peak_after], "prefill": prefill, "decode": decode, "quick": args.quick}
    _results.record("matmul_efficiency", ap, args, figures, kind="wall-clock",
                    baseline="this machine's fp32 GEMM peak, measured in the run",
                    summary=f"{args.threads} thread(s): peak {peak:.0f} GFLOP/s; prefill {prefill['gflop_s']} GFLOP/s = "
                            f"{prefill['of_peak']:.0%} (target >= 60%: {'met' if prefill['of_peak'] >= 0.6 else '**not met**'}); "
                            f"decode {decode['of_peak']:.0%} (weights streamed at {decode['weight_gb_s']} GB/s); ours only")


if __name__ == "__main__":
    _results.run(main)
