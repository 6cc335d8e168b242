"""Routed experts of a prefill chunk on the CPU in one call (``cpu_moe.c``), on packed weights.

Each expert's GEMMs in a prefill chunk have few rows (a 320-token chunk over 8 experts, top-2:
~80 rows each), where oneDNN ran the vs_vllm MiMo checkpoint's experts at ~100-140 GFLOP/s on
2 threads against ~200 for big GEMMs, and the gather into expert-contiguous rows, the weighting
and the ``index_add_`` back cost ~5 ms a layer at 2,048 tokens. Here the tokens' rows are read
in place, each column block of the two products runs for every expert as one work item on the
few-row kernel's pool (``cpu_gemv.par_for_address``), SiLU is applied to the accumulators and
the down product is added, weighted, straight into each token's output row. Results do not
depend on the thread count.

``pack`` makes the kernel's copy of the weights once (the same size as the stacked weights; the
per-expert oneDNN copies it replaces are then never made).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ..ckernels import FAST_FLAGS, CKernel
from . import cpu_gemv

SOURCE = Path(__file__).with_name("cpu_moe.c")


def _bind(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.mmserve_moe_vl.argtypes = []
    lib.mmserve_moe_vl.restype = i64
    lib.mmserve_moe_pack_f32.argtypes = [p, p, i64, i64, i64, p, p]
    lib.mmserve_moe_pack_f32.restype = ctypes.c_int
    lib.mmserve_moe_packed_f32.argtypes = [p, i64, i64, p, p, i64, p, p, i64, i64, p, p, p, i64]
    lib.mmserve_moe_packed_f32.restype = ctypes.c_int


# -fopenmp-simd: the SiLU loop over a tile's accumulators calls the vector expf (libmvec)
KERNEL = CKernel(SOURCE, "cpu_moe", _bind, what="CPU routed-experts kernel",
                 fallback="routed experts of prefill chunks run per-expert oneDNN GEMMs",
                 flags=FAST_FLAGS + ("-fopenmp-simd",))


def packable(gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether ``pack`` takes these stacked weights (CPU float32 ``gate_up [E, 2I, H]``,
    ``down [E, H, I]``, I a multiple of the kernel's vector width and H of twice it) here."""
    if not (gate_up.device.type == "cpu" and gate_up.dtype == torch.float32 and down.dtype == torch.float32
            and gate_up.dim() == 3 and down.dim() == 3):
        return False
    lib = KERNEL.load()
    if lib is None:
        return False
    vl = lib.mmserve_moe_vl()
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
    weights, ``packed`` from ``pack`` -> [T, H]. On the few-row kernel's pool with torch's thread
    count (a prefill's; the pool is elastic, so a busy core costs no barrier wait) unless
    ``threads`` is given."""
    gp, dp = packed
    e, i2, h = gp.shape
    t, k = idx.shape
    x = x.contiguous()
    idx = idx.to(torch.int64).contiguous()
    w = w.to(torch.float32).contiguous()
    scratch = torch.empty(t * k, i2 // 2, dtype=torch.float32)
    out = torch.empty(t, h, dtype=torch.float32)
    n = torch.get_num_threads() if threads is None else threads
    pool = cpu_gemv.par_for_address() if n > 1 else None
    rc = KERNEL.load().mmserve_moe_packed_f32(x.data_ptr(), t, h, idx.data_ptr(), w.data_ptr(), k, gp.data_ptr(),
                                              dp.data_ptr(), e, i2 // 2, scratch.data_ptr(), out.data_ptr(), pool, n)
    if rc != 0:
        raise ValueError(f"routed experts: an expert index outside [0, {e}) (or out of memory)")
    return out
