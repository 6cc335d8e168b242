"""The packed kernels at bfloat16 against float32, at the ``vs_vllm`` MiMo checkpoint's shapes.

Each linear of the checkpoint (hidden 512: q|k|v 512 -> 1152, o 768 -> 512, the dense MLP's
gate|up 512 -> 2048 and down 1024 -> 512, the LM head 512 -> 4096) and one MoE layer (8 experts
of 256, top 2), at a decode step's rows (1, 16) and a prefill chunk's (512), three ways:

* ``bf16``: bfloat16 weights and activations, as the engine runs ``--dtype bfloat16`` (x widened
  and the result rounded inside the call: ``cpu_packed.gemm`` / ``moe_w`` on bfloat16 tensors);
* ``bf16_torch_cvt``: the same kernel with the conversions done by torch around a float32 call
  (``x.float()`` in, ``.to(bfloat16)`` out), what the engine did before the kernels took
  bfloat16 activations;
* ``f32``: float32 weights and activations (the float32 engine).

One thread, CPU time of the calling thread (``time.thread_time``: a busy machine's other work
does not count), the three interleaved and the best of ``--reps`` rounds; ``--distinct`` weights
per shape (16) so a decode-sized call streams its weight from memory as a step's layers do.
Ratios ``bf16 / f32`` and ``bf16 / bf16_torch_cvt`` (below 1: bfloat16 faster).

    python -m benchmarks.bf16_kernels [--quick]

The last line is a JSON object (``"kind": "wall-clock"``).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from benchmarks import _results

SHAPES = {"qkv": (1152, 512), "o": (512, 768), "gate_up": (2048, 512), "down": (512, 1024), "lm_head": (4096, 512)}
EXPERTS, HIDDEN, INTER, TOP_K = 8, 512, 256, 2
WAYS = ("bf16", "bf16_torch_cvt", "f32")


def best_of(fns: dict, reps: int, inner: int) -> dict[str, float]:
    """us per call of each of ``fns`` (each call runs ``inner`` times), best of ``reps`` interleaved rounds."""
    best = dict.fromkeys(fns, float("inf"))
    for f in fns.values():
        f()  # first calls (kernel builds, page faults) are not timed
    for _ in range(reps):
        for name, f in fns.items():
            t0 = time.thread_time()
            for _ in range(inner):
                f()
            best[name] = min(best[name], (time.thread_time() - t0) / inner * 1e6)
    return best


def linears(rows: int, distinct: int, reps: int) -> dict[str, dict[str, float]]:
    from llm_svc.models import cpu_packed, qweight

    out = {}
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k) * 0.05 for _ in range(distinct)]
        pb = [qweight.pack("bfloat16", w.bfloat16()) for w in ws]
        pf = [qweight.pack("float32", w) for w in ws]
        xb = torch.randn(rows, k).bfloat16()
        xf = xb.float()
        fns = {"bf16": lambda: [cpu_packed.gemm(xb, p, threads=1) for p in pb],
               "bf16_torch_cvt": lambda: [cpu_packed.gemm(xb.float(), p, threads=1).to(torch.bfloat16) for p in pb],
               "f32": lambda: [cpu_packed.gemm(xf, p, threads=1) for p in pf]}
        inner = max(1, int(3e3 / (rows * n * k * distinct / 1e6 + 30)))
        out[f"{name}/{rows}"] = {w: round(us / distinct, 1) for w, us in best_of(fns, reps, inner).items()}
    return out


def moe(tokens: int, layers: int, reps: int) -> dict[str, float]:
    from llm_svc.models import cpu_packed
    from llm_svc.models.fused_mlp import RoutedExperts

    g = torch.Generator().manual_seed(tokens)
    gu = [torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.05 for _ in range(layers)]
    dn = [torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.05 for _ in range(layers)]
    by = {dt: [RoutedExperts(a.to(dt).contiguous(), b.to(dt).contiguous(), F.silu) for a, b in zip(gu, dn)]
          for dt in (torch.bfloat16, torch.float32)}
    xb = torch.randn(tokens, HIDDEN, generator=g).bfloat16()
    xf = xb.float()
    idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)])
    w = torch.rand(tokens, TOP_K, generator=g)
    fns = {"bf16": lambda: [e(xb, idx, w) for e in by[torch.bfloat16]],
           "bf16_torch_cvt": lambda: [cpu_packed.moe_w(xb.float(), idx, w, e.packed, threads=1).to(torch.bfloat16)
                                      for e in by[torch.bfloat16]],
           "f32": lambda: [e(xf, idx, w) for e in by[torch.float32]]}
    inner = max(1, int(200 / tokens))
    return {k: round(v / layers, 1) for k, v in best_of(fns, reps, inner).items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds")
    ap.add_argument("--reps", type=int, default=None, help="interleaved rounds (default 9; 5 --quick)")
    ap.add_argument("--distinct", type=int, default=16, help="distinct weights per linear shape")
    _results.add_mode_args(ap)
    args = ap.parse_args()
    from llm_svc.models import cpu_gemv

    torch.set_num_threads(1)
    cpu_gemv.set_threads(1)
    reps = args.reps or (2 if args.smoke else 5 if args.quick else 9)
    rows = (1, 16) if args.smoke else (1, 16, 512)
    times: dict[str, dict[str, float]] = {}
    for r in rows:
        times.update(linears(r, 2 if args.smoke else args.distinct, reps))
        times[f"moe/{r}"] = moe(r, 2 if args.smoke else 7, reps)
    ratios = {k: {"bf16_over_f32": round(v["bf16"] / v["f32"], 3),
                  "bf16_over_torch_cvt": round(v["bf16"] / v["bf16_torch_cvt"], 3)} for k, v in times.items()}
    for k, v in times.items():
        print(f"{k:14s} " + "  ".join(f"{w} {v[w]:9.1f} us" for w in WAYS)
              + f"   bf16/f32 {ratios[k]['bf16_over_f32']:.2f}  bf16/torch-cvt {ratios[k]['bf16_over_torch_cvt']:.2f}")
    worst = max(r["bf16_over_f32"] for r in ratios.values())
    figures = {"us": times, "ratios": ratios, "worst_bf16_over_f32": worst, "threads": 1, "reps": reps}
    _results.record("bf16_kernels", ap, args, figures, kind="wall-clock", baseline="float32 weights and activations",
                    summary=f"bfloat16 kernels / float32 at the MiMo bench shapes: worst {worst:.2f}x (one thread)",
                    skipped=["512 rows", "most rounds"] if args.smoke else [])
    return 0


if __name__ == "__main__":
    _results.run(main)
