"""One MiMo-V2-Flash MoE decoder layer at its published size (hidden 4096, 256 experts of 2048,
top 8; a full-attention layer's projections: 64 query heads of 192, 4 KV heads of 192 / 128),
random weights in FP8 e4m3 with 128x128 block scales as published, built the way the server
builds it (``qweight.pack`` / ``pack_experts`` from the stored bytes and scales, one expert at a
time), with its weights kept FP8 against the same layer in bfloat16 and float32 weights.

A step is the layer's GEMMs as the engine runs them (RMSNorm, q | k | v in one packed GEMM, o,
the C router, the routed experts in one C call); the attention's scores and softmax are left out
(the same for every weight format; a slice of q stands in for their output). Timed: a decode
step of 1 and of 16 tokens (fresh random tokens each repetition, so the experts they route to
change) and a 2,048-token prefill.

Memory: the float32 layer would take ~26 GB (the bfloat16 one ~13 GB) on this 24 GiB machine,
so the FP8 layer is built whole (its resident bytes measured: RSS growth while it is built,
against the checkpoint's FP8 bytes: ``figures.resident_over_fp8_bytes``, target <= 1.15) and the
three formats are compared on a slice of the experts (``--slice``, the first N of the 256; the
router over those N): FP8 on views of the whole layer's first N experts, bfloat16 and float32
widened from them. The sides alternate within each repetition (fp8, bfloat16, float32, then
the next repetition), medians reported. Target: FP8 decode at 16 tokens >= 2.5x float32's speed
(``figures.ratios["decode16/fp8_over_float32"]``, on the slice). vLLM's layer is not built here.

    python -m benchmarks.real_layer [--quick] [--slice N] [--reps N] [--threads N]

The last line is JSON (``"kind": "wall-clock"``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from benchmarks import _results

BLOCK = (128, 128)


@dataclass(frozen=True)
class Dims:
    hidden: int = 4096
    experts: int = 256
    inter: int = 2048
    top_k: int = 8
    heads: int = 64
    kv_heads: int = 4
    qk_dim: int = 192
    v_dim: int = 128


PUBLISHED = Dims()
SMOKE = Dims(hidden=256, experts=16, inter=128, top_k=4, heads=4, kv_heads=2, qk_dim=64, v_dim=32)


def _rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _fp8(g: torch.Generator, n: int, k: int) -> dict:
    """A stored FP8 weight [n, k] as published: e4m3 bytes (|v| < 32, both signs, subnormals
    included) and a float32 scale_inv grid of 128x128 blocks (~1e-3: weights of ~0.03)."""
    b = torch.randint(0, 0x60, (n, k), generator=g, dtype=torch.uint8)
    b |= torch.randint(0, 2, (n, k), generator=g, dtype=torch.uint8) << 7
    s = torch.rand(-(-n // BLOCK[0]), -(-k // BLOCK[1]), generator=g) * 1e-3 + 5e-4
    return {"w": b.view(torch.float8_e4m3fn), "scale": s, "block": BLOCK}


def _stored_bytes(n: int, k: int) -> int:
    return n * k + 4 * -(-n // BLOCK[0]) * -(-k // BLOCK[1])


class Layer:
    """The layer's packed weights of one format: ``qkv``, ``o`` (``PackedWeight``), ``experts``
    (``PackedExperts``), the float32 router and norms."""

    def __init__(self, d: Dims, qkv, o, experts, router: torch.Tensor, bias: torch.Tensor):
        self.d, self.qkv, self.o, self.experts, self.router, self.bias = d, qkv, o, experts, router, bias
        self.norm = torch.ones(d.hidden)

    def step(self, x: torch.Tensor, threads: int) -> torch.Tensor:
        from llm_svc.models import cpu_gemv, cpu_packed

        t, d = x.shape[0], self.d
        h = torch.nn.functional.rms_norm(x, (d.hidden,), self.norm, 1e-6)
        qkv = cpu_packed.gemm(h, self.qkv, threads=threads)  # [T, (64 + 4) * 192 + 4 * 128]
        q = qkv[:, :d.heads * d.qk_dim].view(t, d.heads, d.qk_dim)
        attn_out = q[..., :d.v_dim].reshape(t, -1)  # [T, 64 * 128]: stands in for attention's output
        x = x + cpu_packed.gemm(attn_out, self.o, threads=threads)
        h = torch.nn.functional.rms_norm(x, (d.hidden,), self.norm, 1e-6)
        idx, w = cpu_gemv.route(h, self.router, self.bias, d.top_k, True, 2.5)
        return x + cpu_packed.moe_w(h, idx, w, self.experts, threads=threads)


def build_fp8(d: Dims, seed: int) -> tuple[Layer, dict, int]:
    """The whole FP8 layer from random stored tensors; its stored bytes by part, and the RSS it added."""
    from llm_svc.models import qweight

    g = torch.Generator().manual_seed(seed)
    h, i = d.hidden, d.inter
    before = _rss()
    q = qweight.pack("fp8", **_fp8(g, d.heads * d.qk_dim + d.kv_heads * (d.qk_dim + d.v_dim), h))
    o = qweight.pack("fp8", **_fp8(g, h, d.heads * d.v_dim))
    experts = qweight.pack_experts(d.experts, lambda e: qweight.pack("fp8", **_fp8(g, 2 * i, h)),
                                   lambda e: qweight.pack("fp8", **_fp8(g, h, i)))
    router, bias = torch.randn(d.experts, h, generator=g) * h ** -0.5, torch.zeros(d.experts)
    grew = _rss() - before
    stored = {"attention": _stored_bytes(q.n, h) + _stored_bytes(h, o.k),
              "experts": d.experts * (_stored_bytes(2 * i, h) + _stored_bytes(h, i)), "router_f32": router.numel() * 4}
    return Layer(d, q, o, experts, router, bias), stored, grew


def slice_of(layer: Layer, n: int, fmt: str) -> Layer:
    """The layer with its first ``n`` experts: FP8 as views of ``layer``; bfloat16 / float32
    packed from the dequantized FP8 weights, one expert at a time."""
    from llm_svc.models import qweight
    from llm_svc.models.qweight import PackedExperts, PackedWeight

    ex = layer.experts
    router, bias = layer.router[:n].contiguous(), layer.bias[:n].contiguous()
    if fmt == "fp8":
        def part(p: PackedWeight) -> PackedWeight:
            return PackedWeight(p.fmt, p.n, p.k, p.data[:n], p.scales[:n], p.kernel)

        return Layer(layer.d, layer.qkv, layer.o, PackedExperts(ex.fmt, n, ex.hidden, ex.inter, part(ex.gate_up),
                                                                part(ex.down), ex.kernel), router, bias)
    dtype = torch.float32 if fmt == "float32" else torch.bfloat16
    # unpacking an expert's stacked gate | up gives its tiles' interleaved row order: packing
    # that order again interleaves it again, so the rows are put back first (qweight.dense_of)
    j = torch.arange(ex.inter).view(-1, qweight._vl(ex.kernel))
    order = torch.cat((j, j + ex.inter), 1).reshape(-1)

    def expert(p: PackedWeight, e: int, interleaved: bool) -> PackedWeight:
        w = qweight.dense(PackedWeight(p.fmt, p.n, p.k, p.data[e], p.scales[e], p.kernel))
        if interleaved:
            stored = torch.empty_like(w)
            stored[order] = w
            w = stored
        return qweight.pack(fmt, w.to(dtype))

    experts = qweight.pack_experts(n, lambda e: expert(ex.gate_up, e, True), lambda e: expert(ex.down, e, False))
    return Layer(layer.d, qweight.pack(fmt, qweight.dense(layer.qkv).to(dtype)),
                 qweight.pack(fmt, qweight.dense(layer.o).to(dtype)), experts, router, bias)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 repetitions, a 32-expert slice, one prefill each")
    ap.add_argument("--slice", type=int, default=64, help="experts in the three-format comparison")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--prefill", type=int, default=2048, help="tokens of the prefill")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    _results.add_mode_args(ap)
    args = ap.parse_args()
    d = PUBLISHED
    prefill_reps = args.reps
    if args.smoke:  # the same code on a layer of kilobytes
        d, args.slice, args.reps, args.prefill, prefill_reps = SMOKE, 8, 1, 64, 1
    elif args.quick:
        args.slice, args.reps, prefill_reps = 32, 3, 1
    torch.set_num_threads(args.threads)
    from llm_svc.models import qweight

    if any(qweight.kernel(f) is None for f in ("fp8", "bfloat16", "float32")):
        raise SystemExit("the packed kernels do not build here")
    with torch.inference_mode():
        t0 = time.perf_counter()
        full, stored, grew = build_fp8(d, seed=0)
        build_s = time.perf_counter() - t0
        fp8_bytes = sum(stored.values())
        packed_bytes = full.qkv.nbytes + full.o.nbytes + full.experts.nbytes + full.router.numel() * 4
        print(f"FP8 layer built in {build_s:.0f} s: checkpoint {fp8_bytes / 2**30:.2f} GiB, packed tensors "
              f"{packed_bytes / 2**30:.2f} GiB, RSS grew {grew / 2**30:.2f} GiB", flush=True)
        g = torch.Generator().manual_seed(1)
        decode = {t: [torch.randn(t, d.hidden, generator=g) for _ in range(args.reps)] for t in (1, 16)}
        prefill = torch.randn(args.prefill, d.hidden, generator=g)
        whole = {"decode1_ms": [], "decode16_ms": []}
        for r in range(args.reps):
            for t in (1, 16):
                whole[f"decode{t}_ms"].append(1e3 * timed(lambda: full.step(decode[t][r], args.threads)))
        full.step(prefill[:64], args.threads)
        whole["prefill_s"] = [timed(lambda: full.step(prefill, args.threads)) for _ in range(prefill_reps)]
        whole = {k: round(statistics.median(v), 3) for k, v in whole.items()}
        print(f"FP8 whole layer ({d.experts} experts): {whole}", flush=True)
        sides = {fmt: slice_of(full, args.slice, fmt) for fmt in ("fp8", "bfloat16", "float32")}
        resident = {fmt: s.qkv.nbytes + s.o.nbytes + s.experts.nbytes for fmt, s in sides.items()}
        times = {fmt: {"decode1_ms": [], "decode16_ms": [], "prefill_s": []} for fmt in sides}
        for fmt, s in sides.items():  # warm-up: first touches, the pool's threads
            s.step(decode[16][0], args.threads)
        for r in range(args.reps):
            for fmt, s in sides.items():
                for t in (1, 16):
                    times[fmt][f"decode{t}_ms"].append(1e3 * timed(lambda: s.step(decode[t][r], args.threads)))
                if r < prefill_reps:
                    times[fmt]["prefill_s"].append(timed(lambda: s.step(prefill, args.threads)))
        med = {fmt: {k: round(statistics.median(v), 3) for k, v in d.items()} for fmt, d in times.items()}
        for fmt, m in med.items():
            print(f"{fmt:9s} slice of {args.slice} experts: {m}, packed {resident[fmt] / 2**30:.2f} GiB", flush=True)
    ratios = {}
    for key in ("decode1", "decode16", "prefill"):
        unit = "prefill_s" if key == "prefill" else f"{key}_ms"
        for other in ("float32", "bfloat16"):
            ratios[f"{key}/fp8_over_{other}"] = round(med[other][unit] / med["fp8"][unit], 2)
    over = round(grew / fp8_bytes, 3)
    r16 = ratios["decode16/fp8_over_float32"]
    figures = {
        "layer": asdict(d),
        "threads": args.threads, "reps": args.reps, "prefill_tokens": args.prefill,
        "fp8_bytes": fp8_bytes, "fp8_stored_by_part": stored, "resident_bytes": grew, "packed_tensor_bytes": packed_bytes,
        "resident_over_fp8_bytes": over, "build_s": round(build_s, 1),
        "whole_layer_fp8": whole,
        "slice": {"experts": args.slice, "note": f"float32 (and bfloat16) layers do not fit in RAM at {d.experts} experts "
                                                 f"(~26 / ~13 GB): the three formats are compared on the first "
                                                 f"{args.slice} experts, routed among those",
                  "resident_bytes": resident, "median": med},
        "ratios": ratios, "quick": args.quick,
        "not_measured": "vLLM's layer (its CPU build has no FP8 MoE path here); the attention scores / softmax",
    }
    _results.record("real_layer", ap, args, figures, kind="wall-clock", baseline="the same layer with float32 weights",
                    summary=f"MiMo-V2-Flash MoE layer (4096, 256 x 2048, top 8), {args.threads} threads: FP8 decode "
                            f"at 16 tokens {r16}x float32's speed on a {args.slice}-expert slice (target >= 2.5: "
                            f"{'met' if r16 >= 2.5 else '**not met**'}); resident {over}x the FP8 bytes "
                            f"(target <= 1.15: {'met' if over <= 1.15 else '**not met**'}); whole FP8 layer decode "
                            f"1 / 16 tokens {whole['decode1_ms']} / {whole['decode16_ms']} ms, "
                            f"{args.prefill}-token prefill {whole['prefill_s']} s")


if __name__ == "__main__":
    _results.run(main)
