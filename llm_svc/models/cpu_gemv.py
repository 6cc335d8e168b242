"""Linears of a few rows on the CPU (``cpu_gemv.c``): the weight streamed once, OpenMP threads.

A decode step's linears have 1-8 rows per call (per routed expert, most have one or two): bound
by reading the weight, where oneDNN's GEMM streamed 3-8 GB/s on the 2-core AVX2 dev VM. Measured
there (64 distinct weights, 2 threads, best of 7): [4, 512] x [512, 512] 123 -> 64 us, [4, 256] x
[512, 256] 85 -> 36 us, [8, 512] x [768, 512] 191 -> 125 us; from 16 rows on the two are even
with the same threads, so calls of at most ``MAX_ROWS`` rows come here (``linear.OneDNNLinear``),
or of at most ``MAX_ROWS_FEW_THREADS`` while torch runs on fewer threads than this kernel (a
decode step, ``StepThreads``): [16, 1152] x [1152, 512] oneDNN on 1 thread 490 us, here 340.

Threads: ``set_threads`` (the core: ``StepThreads.gemv``, every core while one is spare). The
kernel's own elastic pool (``par_for`` in the C source), not OpenMP: the caller runs row blocks
from the front, helpers from the back, and the caller waits only for blocks a helper has started.
An OpenMP loop waited for both threads at its barrier, so in the service (the front, the gateway
and the client beside the core on 2 cores) a second thread gave nothing: 4 decodes a step took
13.4 ms on one thread and on two; with the pool 10.7 ms on two (2-core AVX-512 EPYC, vs_vllm
MiMo, median step through the service). Results do not depend on the thread count. The attention
kernels' libraries run their work items on the same pool through ``par_for_address``.

AVX-512 (a 4 x 4 tile of 16-wide vectors, the next tile's weight rows prefetched): on a 2-core
AVX-512 Xeon the AVX2 tile was 1.5-1.9x slower than oneDNN (one thread, 64 distinct weights:
[4, 512] x [512, 512] 129 vs 69 us, [2, 1536] x [512] 432 vs 285); this path takes 44, 234 us
(oneDNN 56-78, 283-290; [4, 4096] x [512] 670 vs 667-715), and the engine's decode step of 4
sequences at 400 tokens went from 21 to 14 ms in-process. Prefetching two tiles ahead or half a
tile was slower.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from llm_svc.kernels.ckernels import FAST_FLAGS, CKernel

SOURCE = Path(__file__).with_name("cpu_gemv.c")
MAX_ROWS = 8
MAX_ROWS_FEW_THREADS = 32


def _bind(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.mmserve_gemv_f32.argtypes = [p, i64, p, p, p, i64, i64, i64, i64, i64]
    lib.mmserve_gemv_f32.restype = ctypes.c_int
    lib.mmserve_moe_f32.argtypes = [p, i64, i64, p, p, i64, p, p, i64, i64, p, i64]
    lib.mmserve_moe_f32.restype = ctypes.c_int
    lib.mmserve_route_f32.argtypes = [p, i64, i64, p, p, i64, i64, i64, ctypes.c_float, p, p, i64]
    lib.mmserve_route_f32.restype = ctypes.c_int
    lib.mmserve_silu_mul_f32.argtypes = [p, i64, p, i64, i64, i64]
    lib.mmserve_silu_mul_f32.restype = ctypes.c_int
    lib.mmserve_gelu_tanh_mul_f32.argtypes = [p, i64, p, i64, i64, i64]
    lib.mmserve_gelu_tanh_mul_f32.restype = ctypes.c_int
    lib.mmserve_pool_helpers.argtypes = []
    lib.mmserve_pool_helpers.restype = i64
    lib.mmserve_par_for.argtypes = [p, p, i64, i64]
    lib.mmserve_par_for.restype = None


KERNEL = CKernel(SOURCE, "cpu_gemv", _bind, what="CPU small-batch linear kernel",
                 fallback="linears of few rows use oneDNN", flags=FAST_FLAGS + ("-pthread",),
                 link_flags=("-shared", "-pthread"))
_threads = 1


def set_threads(n: int) -> None:
    """Threads of every later call (the engine core: ``gemv_threads``)."""
    global _threads
    _threads = max(1, int(n))


def pool_threads() -> int:
    """Threads for other work on the pool now (``cpu_packed``, ``cpu_fused``): a decode step's are
    this kernel's (torch then runs on one), a prefill's torch's; the pool is elastic, so a thread
    whose core another process took costs no wait."""
    return max(_threads, torch.get_num_threads())


def pool(threads: int | None = None) -> tuple[int | None, int]:
    """``(par_for address, threads)`` for a C kernel's call on this pool: ``threads`` (default
    ``pool_threads()``), and the address None when that is one thread (the call runs inline)."""
    n = pool_threads() if threads is None else max(1, int(threads))
    return (par_for_address() if n > 1 else None), n


def par_for_address() -> int | None:
    """Address of the pool's ``mmserve_par_for(fn, ctx, n, threads)`` (C ABI), for other C
    kernels of this process to run their work items on the same helpers; None without the kernel."""
    global _par_for
    if _par_for is None:
        lib = KERNEL.load()
        _par_for = None if lib is None else ctypes.cast(lib.mmserve_par_for, ctypes.c_void_p).value
    return _par_for


_par_for: int | None = None


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` runs ``x @ weight.T`` here: CPU float32, a contiguous weight, few rows
    of x (see the module docstring) with unit stride inside a row, and the kernel built."""
    if not (x.device.type == "cpu" and x.dtype == torch.float32 and x.numel() > 0 and x.stride(-1) == 1):
        return False
    cap = MAX_ROWS if torch.get_num_threads() >= _threads else MAX_ROWS_FEW_THREADS
    return (x.numel() <= cap * x.shape[-1] and weight.dtype == torch.float32 and weight.is_contiguous()
            and KERNEL.available())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ weight[N, K].T + bias[N]`` -> [..., N] (check ``supports`` first)."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    rc = KERNEL.load().mmserve_gemv_f32(x2.data_ptr(), x2.stride(0), weight.data_ptr(),
                                        None if bias is None else bias.data_ptr(), out.data_ptr(), n, m, n, k,
                                        _threads)
    assert rc == 0
    return out.view(*x.shape[:-1], n)


# a decode step's tokens, a speculative step's (decodes with their drafts) and small chunks: each
# expert's weight is streamed once for all its rows. [T, 512] over 8 experts of 512 (top 2), one
# thread, AVX-512 Xeon: 8 tokens 0.91 vs 1.33 ms the per-expert oneDNN loop, 32 1.27 vs 1.88, 64
# 2.43 vs 2.83 (n-gram speculation at 8 requests x 5 rows took the loop: 0.6x the plain decode)
MOE_MAX_TOKENS = 64
# ... and a short prompt's chunk while this kernel has as many threads as torch: the pool runs
# whole experts per thread (no barrier inside an expert's two products) where oneDNN splits each
# small GEMM over both. One MoE layer of the vs_vllm MiMo, 2 + 2 threads, 2-core AVX-512 EPYC:
# 32 tokens 1.25 -> 0.52 ms, 64 1.33 -> 0.87, 160 2.92 -> 2.18, 320 4.92 -> 4.70, 2,048 22.8 ->
# 35.7 (oneDNN ahead). The whole in-process prefill, min of 30 twice: 96 tokens 33.1 / 35.7 ->
# 31.1 / 28.3 ms, 128 41.2 -> 36.1 (cap 256), 160 46.7 / 47.0 -> 45.0 / 44.9, 200 58.5 -> 61.5
MOE_MAX_TOKENS_ALL_THREADS = 160


def _few_tokens(x: torch.Tensor, *weights: torch.Tensor, cap: int | None = MOE_MAX_TOKENS) -> bool:
    """x [T, H] CPU float32 with 1..``cap`` rows (a decode step's or a small one's; ``cap`` None:
    any number), ``weights`` float32 and contiguous, and the kernel built: what ``moe`` and
    ``route`` both need."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and 0 < x.shape[0]
            and (cap is None or x.shape[0] <= cap)
            and all(w.dtype == torch.float32 and w.is_contiguous() for w in weights) and KERNEL.available())


def supports_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether ``moe`` runs this routed-experts call: CPU float32, at most ``MOE_MAX_TOKENS``
    tokens (a decode step's; ``MOE_MAX_TOKENS_ALL_THREADS`` while this kernel has at least
    torch's threads), contiguous stacked weights, and the kernel built."""
    cap = MOE_MAX_TOKENS_ALL_THREADS if _threads > 1 and _threads >= torch.get_num_threads() else MOE_MAX_TOKENS
    return _few_tokens(x, gate_up, down, cap=cap)


def moe(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """SiLU-gated routed experts in one call (check ``supports_moe`` first): x [T, H], idx [T, K]
    chosen experts, w [T, K] their weights, gate_up [E, 2I, H], down [E, H, I] -> [T, H]."""
    t, h = x.shape
    k = idx.shape[1]
    e, i2, _ = gate_up.shape
    x = x.contiguous()
    idx = idx.to(torch.int64).contiguous()
    w = w.to(torch.float32).contiguous()
    out = torch.empty(t, h, dtype=torch.float32)
    rc = KERNEL.load().mmserve_moe_f32(x.data_ptr(), t, h, idx.data_ptr(), w.data_ptr(), k, gate_up.data_ptr(),
                                       down.data_ptr(), e, i2 // 2, out.data_ptr(), _threads)
    if rc != 0:
        raise ValueError(f"routed experts: an expert index outside [0, {e}) (or out of memory)")
    return out


def supports_route(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``route`` runs this call: x [T, H] CPU float32 (any T), a float32 contiguous router
    weight of at most 256 experts, and the kernel built; or x and weight both bfloat16 (a model
    served at bfloat16: scored in float32, as the eager router does)."""
    if x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16:
        return (weight.shape[0] <= 256 and x.device.type == "cpu" and x.dim() == 2 and 0 < x.shape[0]
                and weight.dim() == 2 and KERNEL.available())
    return weight.shape[0] <= 256 and _few_tokens(x, weight, cap=None)


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, norm: bool,
          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """MiMo's sigmoid router with one expert group (check ``supports_route`` first): x [T, H],
    weight [E, H] float32 contiguous, bias [E] or None (steers the choice only) -> (idx [T, K]
    int64, descending by score + bias; w [T, K] the chosen raw scores, renormalized when
    ``norm``, times ``scale``)."""
    t, h = x.shape
    e = weight.shape[0]
    # a bfloat16 model's router scores in float32 (the eager router widens both too): the
    # weight is [E, H], a few thousand elements, widened per call
    x = x.float().contiguous() if x.dtype != torch.float32 else x.contiguous()
    weight = weight.float().contiguous() if weight.dtype != torch.float32 else weight
    idx = torch.empty(t, top_k, dtype=torch.int64)
    w = torch.empty(t, top_k, dtype=torch.float32)
    b = None if bias is None else bias.to(torch.float32).contiguous()
    rc = KERNEL.load().mmserve_route_f32(x.data_ptr(), t, h, weight.data_ptr(), None if b is None else b.data_ptr(),
                                         e, top_k, int(norm), float(scale), idx.data_ptr(), w.data_ptr(),
                                         pool_threads())
    if rc != 0:
        raise ValueError(f"router: top_k {top_k} of {e} experts is not served by the CPU kernel")
    return idx, w


def supports_gated_mul(gu: torch.Tensor) -> bool:
    """Whether ``silu_mul`` and ``gelu_tanh_mul`` run here: CPU float32 rows ``[T, 2I]`` with unit
    stride inside a row."""
    return (gu.device.type == "cpu" and gu.dtype == torch.float32 and gu.dim() == 2 and gu.stride(1) == 1
            and gu.shape[1] % 2 == 0 and KERNEL.available())


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a gated MLP's fused projection ``gu [T, 2I]`` (gate | up; check
    ``supports_gated_mul`` first) -> [T, I] in one pass, on torch's thread count."""
    t, i2 = gu.shape
    out = torch.empty(t, i2 // 2, dtype=torch.float32)
    KERNEL.load().mmserve_silu_mul_f32(gu.data_ptr(), gu.stride(0), out.data_ptr(), t, i2 // 2, torch.get_num_threads())
    return out


def gelu_tanh_mul(gu: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` of ``gu [T, 2I]`` (as ``silu_mul``; check
    ``supports_gated_mul`` first) -> [T, I] in one pass, on torch's thread count."""
    t, i2 = gu.shape
    out = torch.empty(t, i2 // 2, dtype=torch.float32)
    KERNEL.load().mmserve_gelu_tanh_mul_f32(gu.data_ptr(), gu.stride(0), out.data_ptr(), t, i2 // 2,
                                            torch.get_num_threads())
    return out
