"""GEMMs on packed weights on the CPU (``cpu_packed.c``): linears, and routed experts in one call.

One broadcast-form micro-kernel (x's scalars times rows of a weight packed K-major) on the
few-row kernel's elastic pool (``cpu_gemv.par_for_address``): a thread whose core another
process takes (the front, the gateway, a client) costs no barrier wait, and results do not
depend on the thread count. ``pack_linear`` / ``pack`` make the kernel's copy of a weight once
(the same size as the weight; it replaces oneDNN's reordered copy).

Linears (``linear``): any row count at its own size, where oneDNN builds a primitive per shape and
so had its rows padded to buckets (~6% more work and a copy per call). 2-core AVX-512 EPYC, 2
threads, against oneDNN with that padding: [1,300, 512] x [512, 1,536] 11.3 -> 10.0 ms, [200, 768]
x [768, 512] 0.91 -> 0.70 ms, bucket sizes (64, 320, 2,048 rows) even at 204-232 GFLOP/s; a
decode step's rows stream the weight faster than the few-row kernel (40 distinct [1,536, 512]
weights, 4 rows: 6.2 -> 3.7 ms on 2 threads, 11.5 -> 5.3 on one).

Routed experts (``moe``): each expert's GEMMs in a prefill chunk have few rows (a 320-token chunk
over 8 experts, top-2: ~80 rows each), where oneDNN ran the vs_vllm MiMo checkpoint's experts at
~100-140 GFLOP/s on 2 threads, and the gather into expert-contiguous rows, the weighting and the
``index_add_`` back cost ~5 ms a layer at 2,048 tokens. Here the tokens' rows are read in place,
each column block of the two products runs for every expert as one work item, SiLU is applied
to the accumulators and the down product is added, weighted, straight into each token's row.

Weight formats (``FORMATS``, ``builds``): one build of the source per weight element type
(``w_elem.h``: float32, bfloat16, FP8 e4m3 with block scales, MXFP4), the way the attention
kernels build per KV dtype. ``gemm`` / ``moe_w`` run any of them on ``qweight.PackedWeight`` /
``PackedExperts``; each tile row is widened to float32 in registers (the arithmetic is float32:
W8A32 / W4A32 / W16A32), so a decode step streams the narrow weight. Activations are float32 or
bfloat16: a bfloat16 x is widened once inside the call and the result rounded to bfloat16 as it
is stored (torch's ``.float()`` / ``.to(bfloat16)`` around a float32 call cost 5-18% of a
decode-sized bfloat16 linear, 2-core AVX2 EPYC, one thread). A tile that several micro-tiles of
rows read (a prefill's GEMM) is widened once, by the first of them, into per-thread scratch that
the others read: a bfloat16 prefill GEMM runs at float32's speed (it was 4-10% behind). Decode-sized
calls run here too (``linear.PackedLinear`` takes every row count), so the few-row kernel
(``cpu_gemv``) stays float32-only: it serves the shapes this kernel does not pack.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from llm_svc.kernels.ckernels import FAST_FLAGS, CKernel
from . import cpu_gemv

SOURCE = Path(__file__).with_name("cpu_packed.c")


def _bind(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.mmserve_packed_vl.argtypes = []
    lib.mmserve_packed_vl.restype = i64
    lib.mmserve_packed_format.argtypes = []
    lib.mmserve_packed_format.restype = i64
    lib.mmserve_gemm_w.argtypes = [p, i64, i64, i64, p, p, i64, p, p, i64, p, i64]
    lib.mmserve_gemm_w.restype = ctypes.c_int
    lib.mmserve_moe_w.argtypes = [p, i64, i64, p, p, i64, p, p, p, p, i64, i64, p, p, p, i64]
    lib.mmserve_moe_w.restype = ctypes.c_int
    lib.mmserve_gemm_wa.argtypes = [p, i64, i64, i64, p, p, i64, p, p, i64, i64, p, i64]
    lib.mmserve_gemm_wa.restype = ctypes.c_int
    lib.mmserve_moe_wa.argtypes = [p, i64, i64, p, p, i64, p, p, p, p, i64, i64, p, p, i64, p, i64]
    lib.mmserve_moe_wa.restype = ctypes.c_int
    if lib.mmserve_packed_format() != 0:
        return  # the narrow formats are packed in Python (qweight.py)
    lib.mmserve_gemm_pack_f32.argtypes = [p, i64, i64, p]
    lib.mmserve_gemm_pack_f32.restype = ctypes.c_int
    lib.mmserve_gemm_f32.argtypes = [p, i64, i64, i64, p, i64, p, p, i64, p, i64]
    lib.mmserve_gemm_f32.restype = ctypes.c_int
    lib.mmserve_moe_pack_f32.argtypes = [p, p, i64, i64, i64, p, p]
    lib.mmserve_moe_pack_f32.restype = ctypes.c_int
    lib.mmserve_moe_packed_f32.argtypes = [p, i64, i64, p, p, i64, p, p, i64, i64, p, p, p, i64]
    lib.mmserve_moe_packed_f32.restype = ctypes.c_int


HEADERS = (SOURCE.with_name("w_elem.h"),)
# weight format -> the -D flag of its build (w_elem.h); float32 is the plain build
FORMATS = {"float32": (), "bfloat16": ("-DW_BF16",), "fp8": ("-DW_FP8",), "mxfp4": ("-DW_MXFP4",)}


def builds(extra_flags: tuple[str, ...] = (), suffix: str = "") -> dict[str, CKernel]:
    """One build of the kernel per weight format (``FORMATS``), each with ``extra_flags`` (the
    tests build the AVX2 path with ``-mno-avx512f``) and ``suffix`` on its name. -fopenmp-simd:
    the SiLU loop over a tile's accumulators calls the vector expf (libmvec)."""
    return {fmt: CKernel(SOURCE, "cpu_packed" + ("" if fmt == "float32" else "_" + fmt) + suffix, _bind,
                         what=f"CPU packed-weight GEMM kernel ({fmt} weights{suffix})",
                         fallback=("linears and routed experts use oneDNN" if fmt == "float32"
                                   else "those weights are dequantized at load"),
                         flags=FAST_FLAGS + ("-fopenmp-simd",) + flags + tuple(extra_flags), headers=HEADERS)
            for fmt, flags in FORMATS.items()}


KERNELS = builds()
KERNEL = KERNELS["float32"]


def linear_packable(weight: torch.Tensor) -> bool:
    """Whether ``pack_linear`` takes ``weight [N, K]`` here (CPU float32, the kernel built)."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2 and KERNEL.available()


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """The kernel's copy of ``weight [N, K]`` (check ``linear_packable``): [ceil(N / 2VL), K, 2VL]."""
    w = weight.detach().contiguous()
    n, k = w.shape
    nb = 2 * KERNEL.load().mmserve_packed_vl()
    wp = torch.empty(-(-n // nb), k, nb, dtype=torch.float32)
    KERNEL.load().mmserve_gemm_pack_f32(w.data_ptr(), n, k, wp.data_ptr())
    return wp


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
           threads: int | None = None) -> torch.Tensor:
    """``x [..., K] @ weight[n, K].T + bias`` -> [..., n] float32, ``packed`` from ``pack_linear``;
    threads as ``moe``."""
    k = packed.shape[1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    if m:
        KERNEL.load().mmserve_gemm_f32(x2.data_ptr(), x2.stride(0), m, k, packed.data_ptr(), n,
                                       None if bias is None else bias.data_ptr(), out.data_ptr(), n,
                                       *cpu_gemv.pool(threads))
    return out.view(*x.shape[:-1], n)


def packable(gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether ``pack`` takes these stacked weights (CPU float32 ``gate_up [E, 2I, H]``,
    ``down [E, H, I]``, I a multiple of the kernel's vector width and H of twice it) here."""
    if not (gate_up.device.type == "cpu" and gate_up.dtype == torch.float32 and down.dtype == torch.float32
            and gate_up.dim() == 3 and down.dim() == 3):
        return False
    lib = KERNEL.load()
    if lib is None:
        return False
    vl = lib.mmserve_packed_vl()
    e, i2, h = gate_up.shape
    return i2 % (2 * vl) == 0 and h % (2 * vl) == 0 and tuple(down.shape) == (e, h, i2 // 2)


def pack(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's copies of ``gate_up [E, 2I, H]`` and ``down [E, H, I]`` (check ``packable``)."""
    gate_up, down = gate_up.detach().contiguous(), down.detach().contiguous()
    e, i2, h = gate_up.shape
    gp, dp = torch.empty_like(gate_up), torch.empty_like(down)
    rc = KERNEL.load().mmserve_moe_pack_f32(gate_up.data_ptr(), down.data_ptr(), e, h, i2 // 2, gp.data_ptr(),
                                            dp.data_ptr())
    assert rc == 0
    return gp, dp


def moe(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor],
        threads: int | None = None) -> torch.Tensor:
    """SiLU-gated routed experts: x [T, H] float32, idx [T, K] chosen experts, w [T, K] their
    weights, ``packed`` from ``pack`` -> [T, H]. On the few-row kernel's pool: a decode step's
    threads are that kernel's (``cpu_gemv.set_threads``), a prefill's torch's, unless ``threads``
    is given."""
    gp, dp = packed
    e, i2, h = gp.shape
    t, k = idx.shape
    x = x.contiguous()
    idx = idx.to(torch.int64).contiguous()
    w = w.to(torch.float32).contiguous()
    scratch = torch.empty(t * k, i2 // 2, dtype=torch.float32)
    out = torch.empty(t, h, dtype=torch.float32)
    rc = KERNEL.load().mmserve_moe_packed_f32(x.data_ptr(), t, h, idx.data_ptr(), w.data_ptr(), k, gp.data_ptr(),
                                              dp.data_ptr(), e, i2 // 2, scratch.data_ptr(), out.data_ptr(),
                                              *cpu_gemv.pool(threads))
    if rc != 0:
        raise ValueError(f"routed experts: an expert index outside [0, {e}) (or out of memory)")
    return out


ACT_DTYPES = (torch.float32, torch.bfloat16)  # activations ``gemm`` / ``moe_w`` take and return as they are


def gemm(x: torch.Tensor, pw, bias: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
    """``x [..., K]`` float32 or bfloat16 times a packed weight ``pw`` (``qweight.PackedWeight``,
    any format) transposed, plus ``bias`` (float32) -> [..., N] in x's dtype; threads as ``moe``.
    Computed in float32 either way: a bfloat16 x is widened inside the call and the result
    rounded to bfloat16 (nearest even) as it is stored, bit for bit what widening x, a float32
    call and ``.to(torch.bfloat16)`` give."""
    k, n = pw.k, pw.n
    if x.shape[-1] != k:
        raise ValueError(f"linear of in_features {k} got input {list(x.shape)}")
    if x.dtype not in ACT_DTYPES:
        raise TypeError(f"packed linear takes float32 or bfloat16 input, got {x.dtype}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype)
    if m:
        rc = pw.kernel.load().mmserve_gemm_wa(x2.data_ptr(), x2.stride(0), m, k, pw.data.data_ptr(),
                                              None if pw.scales is None else pw.scales.data_ptr(), n,
                                              None if bias is None else bias.data_ptr(), out.data_ptr(), n,
                                              int(x.dtype == torch.bfloat16), *cpu_gemv.pool(threads))
        if rc != 0:
            raise MemoryError("packed linear: no memory for the widened rows")
    return out.view(*x.shape[:-1], n)


def moe_w(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, pe, threads: int | None = None) -> torch.Tensor:
    """``moe`` on packed experts ``pe`` (``qweight.PackedExperts``, any format): x [T, H] float32
    or bfloat16, idx [T, K], w [T, K] -> [T, H] in x's dtype (bfloat16: widened and rounded
    inside the call, as ``gemm``)."""
    t, k = idx.shape
    e, h, i = pe.num_experts, pe.hidden, pe.inter
    if x.dtype not in ACT_DTYPES:
        raise TypeError(f"packed experts take float32 or bfloat16 input, got {x.dtype}")
    x = x.contiguous()
    idx = idx.to(torch.int64).contiguous()
    w = w.to(torch.float32).contiguous()
    scratch = torch.empty(t * k, i, dtype=torch.float32)
    out = torch.empty(t, h, dtype=x.dtype)
    g, d = pe.gate_up, pe.down
    rc = pe.kernel.load().mmserve_moe_wa(x.data_ptr(), t, h, idx.data_ptr(), w.data_ptr(), k, g.data.data_ptr(),
                                         None if g.scales is None else g.scales.data_ptr(), d.data.data_ptr(),
                                         None if d.scales is None else d.scales.data_ptr(), e, i,
                                         scratch.data_ptr(), out.data_ptr(), int(x.dtype == torch.bfloat16),
                                         *cpu_gemv.pool(threads))
    if rc != 0:
        raise ValueError(f"routed experts: an expert index outside [0, {e}) (or out of memory)")
    return out
