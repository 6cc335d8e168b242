"""The CPU paged prefill kernel (``cpu_prefill.c``): a chunk's queries over their causal, optionally
sliding, context, K/V read in place from the pool through the slot table, flash-style.

It replaces, for float32 / bfloat16 / float16 pools (one build each), what a prefill bucket did through torch's CPU flash kernel: gather
the context out of the pool (``LayerKV.gather``), then attend it (a mask for sliding windows; for
full layers two calls merged by their log-sum-exp, ``torch_common.attend_tail``). The kernel reads
each K / V row in place, never visits the key blocks past an item's last query, and masks only
the blocks on the diagonal or the window's edge. Bidirectional spans (Gemma 3 images) and
soft-capping stay on the torch path (``supports``).

Threads as ``cpu_paged``: the library releases the GIL, work items (member, query block, kv head)
go round-robin to ``torch.get_num_threads()`` Python threads (or ``cpu_paged.set_threads``' count
when more), so causal items of unequal length share out evenly. Under the engine core (``cpu_paged.use_pool``)
each item is a chunk of the few-row kernel's C pool instead: the step's thread takes items from
the front, the helpers from the back, no Python thread wakes (in-process MiMo prefill of 320
tokens 91-106 -> 84-87 ms; 1,300 tokens about even).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from llm_svc.kernels.ckernels import act_kv_dtype_builds
from . import cpu_paged
from .base import AttentionParams, LayerKV

SOURCE = Path(__file__).with_name("cpu_prefill.c")
MIN_SPLIT_FLOPS = 2e7  # below this many per thread a call runs on one (~0.3 ms of work; a thread hop ~50 us)


def _bind(lib: ctypes.CDLL) -> None:
    fn = lib.mmserve_paged_prefill_f32
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    fn.argtypes = [p] * 10 + [i64] * 9 + [f32, i64, i64]
    fn.restype = ctypes.c_int
    fn = lib.mmserve_paged_prefill_pooled_f32
    fn.argtypes = [p] * 10 + [i64] * 9 + [f32, p, i64]
    fn.restype = ctypes.c_int
    lib.mmserve_prefill_tile_rows.argtypes = []
    lib.mmserve_prefill_tile_rows.restype = i64


# one build per pool dtype: K / V elements are widened to float32 as the kernel reads them; and
# per activation dtype: bfloat16 queries widened as Q^T is packed, output rows rounded as stored
# (``act_elem.h``). ACT_KERNELS: {(activation dtype, pool dtype): build}; KERNELS: float32's by pool dtype.
ACT_KERNELS = act_kv_dtype_builds(SOURCE, "cpu_prefill", _bind, what="CPU paged prefill kernel",
                                  fallback="prefill chunks gather their context")
KERNELS = {kv: k for (act, kv), k in ACT_KERNELS.items() if act == torch.float32}
KERNEL = KERNELS[torch.float32]


def load(kv_dtype: torch.dtype = torch.float32, act_dtype: torch.dtype = torch.float32) -> ctypes.CDLL | None:
    """The build for pools of ``kv_dtype`` and queries / outputs of ``act_dtype`` (built on first
    use); None if it cannot be built."""
    k = KERNELS.get(kv_dtype) if act_dtype == torch.float32 else ACT_KERNELS.get((act_dtype, kv_dtype))
    return None if k is None else k.load()


def available(kv_dtype: torch.dtype = torch.float32, act_dtype: torch.dtype = torch.float32) -> bool:
    return load(kv_dtype, act_dtype) is not None


def supports(q: torch.Tensor, cache: LayerKV, params: AttentionParams) -> bool:
    """Whether ``paged_prefill`` can run these tensors: CPU, float32 or bfloat16 queries (the
    output's dtype), contiguous pools of float32 / bfloat16 / float16, no soft-cap, at most a
    tile's rows (``tile_rows``: 64 in the default builds) of query heads per kv head."""
    return (params.softcap is None and q.device.type == "cpu" and q.dtype in cpu_paged.ACT_DTYPES
            and cache.k.dtype == cache.v.dtype and cache.k.dtype in KERNELS and cache.k.device.type == "cpu"
            and cache.k.is_contiguous() and cache.v.is_contiguous()
            and available(cache.k.dtype, q.dtype) and q.shape[-2] // cache.k.shape[0] <= tile_rows(cache.k.dtype, q.dtype))


@functools.cache
def tile_rows(kv_dtype: torch.dtype = torch.float32, act_dtype: torch.dtype = torch.float32) -> int:
    """Rows of the kernel's tile (query heads x queries) in this machine's build (check ``available``;
    asked once per dtype: ``supports`` runs for every bucket)."""
    return load(kv_dtype, act_dtype).mmserve_prefill_tile_rows()


def paged_prefill(q: torch.Tensor, cache: LayerKV, table: torch.Tensor, trows: torch.Tensor, k0: torch.Tensor,
                  qpos0: torch.Tensor, ns: torch.Tensor, window: int | None, params: AttentionParams,
                  threads: int | None = None) -> torch.Tensor:
    """q [B, NQ, Hq, Dqk] float32 or bfloat16 (pools of any dtype in ``KERNELS``; out of q's
    dtype, computed in float32): member
    ``b``'s first ``ns[b]`` queries at positions
    ``qpos0[b] + i``; the query at position ``p`` reads positions ``max(k0[b], p - W + 1) .. p``
    (``window`` None: from ``k0[b]``) of slot-table row ``trows[b]`` -> [B, NQ, Hq, Dv] (padded
    query rows 0)."""
    lib = load(cache.k.dtype, q.dtype)
    assert lib is not None, "paged_prefill called without the kernel (check supports() first)"
    b, nq, hq, dqk = q.shape
    hkv, num_slots, dv = cache.v.shape
    assert hq % hkv == 0 and cache.k.shape == (hkv, num_slots, dqk), (q.shape, cache.k.shape, cache.v.shape)
    assert table.dtype == torch.long and table.dim() == 2 and table.is_contiguous()
    q = q.contiguous()
    trows, k0, qpos0, ns = (t.to(torch.long).contiguous() for t in (trows, k0, qpos0, ns))
    sinks = None if params.sinks is None else params.sinks.detach().float().contiguous()
    out = torch.zeros(b, nq, hq, dv, dtype=q.dtype)
    args = (q.data_ptr(), cache.k.data_ptr(), cache.v.data_ptr(), table.data_ptr(), trows.data_ptr(), k0.data_ptr(),
            qpos0.data_ptr(), ns.data_ptr(), None if sinks is None else sinks.data_ptr(), out.data_ptr(),
            b, nq, hq, hkv, dqk, dv, num_slots, table.shape[1], int(window or 0), float(params.scale))
    par_for, pool_threads = cpu_paged.pool()
    if threads is None and par_for is not None and pool_threads > 1:
        rc = lib.mmserve_paged_prefill_pooled_f32(*args, par_for, pool_threads)
        assert rc == 0, "paged prefill kernel: out of memory"
        return out
    n = threads or max(torch.get_num_threads(), cpu_paged.thread_count())
    if n > 1:  # causal: a member's queries see about half its keys on average
        keys = (qpos0 + ns - k0) if window is None else torch.clamp(qpos0 + ns - k0, max=int(window) + nq)
        flops = 2.0 * hq * (dqk + dv) * int((ns * keys).sum()) / 2
        n = max(1, min(n, int(flops // MIN_SPLIT_FLOPS)))
    if n == 1:
        assert lib.mmserve_paged_prefill_f32(*args, 0, 1) == 0, "paged prefill kernel: out of memory"
        return out
    futs = [cpu_paged.executor(n).submit(lib.mmserve_paged_prefill_f32, *args, i, n) for i in range(n)]
    assert all(f.result() == 0 for f in futs), "paged prefill kernel: out of memory"
    return out
