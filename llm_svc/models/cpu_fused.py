"""The element-wise work between a layer's GEMMs in one pass each (``cpu_fused.c``), CPU float32
or bfloat16 (one build each: ``KERNELS``).

* ``qkv_post``: rope on a fused q|k|v projection's q and k heads and the value scale on its v,
  in place, bit-identical to the eager ops (the C file is built without -ffast-math and without
  FMA contraction, so every product and sum rounds as torch's do).
* ``add_rmsnorm``: the residual add and the next RMSNorm in one read of the residual.

bfloat16 (a model at ``--dtype bfloat16``): the ``-DACT_BF16`` build widens each row to float32
and rounds every result back as the eager bfloat16 ops round theirs: rope and the value scale
bit-identical to eager, the norm as ``mimo_blocks.RMSNorm`` at bfloat16 (sum of squares in
float32, within one bfloat16 ulp of it: the sum runs in another order). Every tensor of a call
(rows, tables, weight) has one dtype.

Why: in a 4 x 1,300-token prefill of the vs_vllm MiMo checkpoint (2-core AVX2 EPYC, 2 threads)
the eager element-wise ops around the GEMMs (rope's ``mul`` / ``cat`` / ``neg``, the value scale,
residual ``add``, RMSNorm) were about a fifth of the step, each a full pass over the activations.
Threads: blocks of 16 rows on the few-row kernel's elastic pool (``cpu_gemv.par_for_address``),
with a decode step's count for that kernel or a prefill's torch count (``cpu_gemv.pool_threads``).
On torch's libgomp they paid for waking its sleeping team on every pass once the GEMMs moved to
the pool: ~15% of a 320-token prefill of the vs_vllm MiMo checkpoint (py-spy).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from llm_svc.kernels.ckernels import act_dtype_builds
from . import cpu_gemv

SOURCE = Path(__file__).with_name("cpu_fused.c")
# exact: no -ffast-math, no contraction (bit-identical rope); vectorized by lanes, not reassociation
EXACT_FLAGS = ("-O3", "-march=native", "-fPIC", "-std=c11", "-fno-math-errno", "-ffp-contract=off")


def _bind(lib: ctypes.CDLL) -> None:
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.mmserve_qkv_post_f32.argtypes = [p, i64, i64, i64, i64, i64, i64, i64, p, p, i64, f32, ctypes.c_int, p, i64]
    lib.mmserve_qkv_post_f32.restype = ctypes.c_int
    lib.mmserve_add_rmsnorm_f32.argtypes = [p, i64, p, i64, p, p, i64, i64, f32, p, i64]
    lib.mmserve_add_rmsnorm_f32.restype = ctypes.c_int
    lib.mmserve_add_rmsnorm_w32.argtypes = [p, i64, p, i64, p, p, i64, i64, f32, p, i64]
    lib.mmserve_add_rmsnorm_w32.restype = ctypes.c_int


# {activation dtype: build}: float32 and bfloat16 (``-DACT_BF16``, ``act_elem.h``)
KERNELS = act_dtype_builds(SOURCE, "cpu_fused", _bind, what="CPU fused element-wise kernel",
                           fallback="rope, residual adds and norms run as eager torch ops", flags=EXACT_FLAGS)
KERNEL = KERNELS[torch.float32]


def _lib(dtype: torch.dtype):
    k = KERNEL if dtype == torch.float32 else KERNELS.get(dtype)  # KERNEL: a test may swap it
    return None if k is None else k.load()


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether the build for activations of ``dtype`` exists here (built on first use)."""
    return _lib(dtype) is not None


def _cpu_same(*ts: torch.Tensor) -> bool:
    dt = ts[0].dtype
    return dt in KERNELS and all(t.device.type == "cpu" and t.dtype == dt for t in ts)


def supports_qkv(buf: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether ``qkv_post`` runs here: CPU 2-D rows with unit stride inside a row, tables likewise,
    all float32 or all bfloat16, and that dtype's kernel built."""
    return (_cpu_same(buf, cos, sin) and buf.dim() == 2 and buf.stride(1) == 1 and cos.dim() == 2
            and cos.stride(1) == 1 and sin.stride() == cos.stride() and available(buf.dtype))


def qkv_post(buf: torch.Tensor, hq: int, hk: int, d: int, dv: int, cos: torch.Tensor, sin: torch.Tensor,
             vscale: float = 1.0) -> None:
    """In place on ``buf [T, (hq + hk) * d + hk * dv]`` (check ``supports_qkv`` first): rope
    (rotate-half form) on the first ``R`` dims of each of the ``hq + hk`` q / k heads with
    ``cos / sin [T, R]`` (equal halves, as transformers' tables), then v times ``vscale``."""
    t, width = buf.shape
    r = cos.shape[1]
    if width != (hq + hk) * d + hk * dv or cos.shape[0] != t or sin.shape != cos.shape:
        raise ValueError(f"qkv rows of width {width} / tables {tuple(cos.shape)} do not match {hq}+{hk} heads of {d}, {dv}")
    rc = _lib(buf.dtype).mmserve_qkv_post_f32(buf.data_ptr(), t, buf.stride(0), hq, hk, d, dv, r, cos.data_ptr(),
                                            sin.data_ptr(), cos.stride(0), float(vscale), int(vscale != 1.0),
                                            *cpu_gemv.pool())
    if rc != 0:
        raise ValueError(f"rope dims {r} must be even and at most the head dim {d}")


def supports_norm(h: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``add_rmsnorm`` runs here: CPU 2-D rows with unit stride inside a row, a contiguous
    weight of their dtype (float32 or bfloat16), and that dtype's kernel built."""
    return _cpu_same(h, weight) and _norm_rows(h, weight)


def supports_norm_w32(h: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``add_rmsnorm`` runs here with a float32 ``weight`` on rows of their own dtype
    (float32 or bfloat16; Gemma's ``1 + weight``, multiplied in float32 and rounded once)."""
    return _cpu_same(h) and _cpu_same(weight) and weight.dtype == torch.float32 and _norm_rows(h, weight)


def _norm_rows(h: torch.Tensor, weight: torch.Tensor) -> bool:
    return h.dim() == 2 and h.stride(1) == 1 and weight.is_contiguous() and available(h.dtype)


def add_rmsnorm(h: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``h += y`` in place (``y`` None: no add), then ``rmsnorm(h) * weight`` as a new tensor:
    h, y [T, H] (check ``supports_norm`` first; y with unit stride inside a row). A float32
    ``weight`` on bfloat16 rows (``supports_norm_w32``): the product in float32, rounded once."""
    t, n = h.shape
    if y is not None and (y.shape != h.shape or y.stride(1) != 1 or not _cpu_same(h, y)):
        raise ValueError(f"residual {tuple(y.shape)} {y.dtype} does not match the hidden states "
                         f"{tuple(h.shape)} {h.dtype}")
    out = torch.empty(t, n, dtype=h.dtype)
    lib = _lib(h.dtype)
    fn = lib.mmserve_add_rmsnorm_w32 if weight.dtype == torch.float32 else lib.mmserve_add_rmsnorm_f32
    fn(h.data_ptr(), h.stride(0), None if y is None else y.data_ptr(), 0 if y is None else y.stride(0),
       weight.data_ptr(), out.data_ptr(), t, n, float(eps), *cpu_gemv.pool())
    return out
