"""The CPU paged decode kernel (``cpu_paged.c``): built once per machine (``llm_svc.kernels.ckernels``), called through ctypes.

Decodes are bound by reading the context: gathering it out of the pool first (``LayerKV.gather``)
reads it, writes a copy and reads the copy again. The kernel reads each K/V row once, in place,
through the bucket's slot table. A missing compiler or a failed build leaves ``available()``
False and the callers on the torch path.

ctypes releases the GIL for the call, so a step with many work items is split over Python
threads, each running a range of ``(sequence, kv head)``: ``torch.get_num_threads()`` of them, or
``set_threads``' count when that is more (the engine core: every core). A decode step runs torch
on one thread (``StepThreads``: its hundreds of small ops gain nothing from a second), but its
attention over long contexts is one big read that a second core nearly halves: tiny MiMo, 16
sequences x 32K context, one thread 28.5 ms a step (2-core AVX2 EPYC). Only a step with at least
``MIN_SPLIT_KEYS`` key rows per thread splits.

The engine core instead runs every call on the few-row linear kernel's C pool (``use_pool``,
set each step by ``StepThreads`` with its count): the step's thread works too and its helpers
are awake from the step's linears, so a split costs microseconds and even a short decode's
attention halves its time (the reads are bound by one core's memory bandwidth). vs_vllm Gemma 3
checkpoint (12 layers, window 512), 4 sequences at ~1,000 tokens, in-process on the 2-core AVX-512
EPYC: attention 5.8 -> 3.5 ms of a 16.8 -> 14.3 ms decode step; MiMo 10.0-10.4 -> 9.1-9.6 ms.
"""

from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from llm_svc.kernels.ckernels import act_kv_dtype_builds
from .base import AttentionParams, LayerKV

SOURCE = Path(__file__).with_name("cpu_paged.c")
MIN_SPLIT_KEYS = 1 << 15  # below this many key rows a step runs on one thread (a thread hop costs ~50 us)

_pool: ThreadPoolExecutor | None = None
_threads = 0  # 0: torch's count
_par_for: int | None = None  # address of a C pool's mmserve_par_for (``use_pool``)
_par_threads = 1
POOL_CHUNKS = 64  # at most this many work ranges per call on the C pool (each is its own malloc)


def set_threads(n: int) -> None:
    """Threads a long decode step may split over, even while torch runs on fewer (0: torch's)."""
    global _threads
    _threads = max(0, int(n))


def _bind(lib: ctypes.CDLL) -> None:
    fn = lib.mmserve_paged_decode_f32
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    fn.argtypes = [p] * 9 + [i64] * 7 + [f32, f32, i64, i64]
    fn.restype = ctypes.c_int
    fn = lib.mmserve_paged_decode_pooled_f32
    fn.argtypes = [p] * 9 + [i64] * 7 + [f32, f32, p, i64, i64]
    fn.restype = ctypes.c_int
    fn = lib.mmserve_paged_write_f32  # rows of the build's activation dtype into pools of its KV dtype
    fn.argtypes = [p, p, i64, i64, i64, i64, p, i64, p, i64, p, i64]
    fn.restype = ctypes.c_int


# one build per pool dtype: bfloat16 / float16 K / V rows are widened to float32 as they are loaded
# (half the bytes of a long context's read; tiny MiMo, 16 x 32K, 2 threads: docs/engine.md, `kv_dtype`),
# and per activation dtype: bfloat16 queries widened per item, outputs rounded as stored
# (``act_elem.h``). ACT_KERNELS: {(activation dtype, pool dtype): build}; KERNELS: the float32
# activations' builds by pool dtype.
ACT_KERNELS = act_kv_dtype_builds(SOURCE, "cpu_paged", _bind, what="CPU paged decode kernel",
                                  fallback="decodes gather their context")
KERNELS = {kv: k for (act, kv), k in ACT_KERNELS.items() if act == torch.float32}
KERNEL = KERNELS[torch.float32]
ACT_DTYPES = (torch.float32, torch.bfloat16)  # the activation dtypes the kernels take


def library_path() -> Path:
    """Where this machine's build of the kernel lives (built or not)."""
    return KERNEL.library_path()


def load(kv_dtype: torch.dtype = torch.float32, act_dtype: torch.dtype = torch.float32) -> ctypes.CDLL | None:
    """The build for pools of ``kv_dtype`` and activations (queries, outputs, written rows) of
    ``act_dtype``, built on first use; None if it cannot be built here (logged once) or there is
    none for those dtypes."""
    if act_dtype == torch.float32:
        k = KERNEL if kv_dtype == torch.float32 else KERNELS.get(kv_dtype)  # KERNEL: a test may swap it
    else:
        k = ACT_KERNELS.get((act_dtype, kv_dtype))
    return None if k is None else k.load()


def available(kv_dtype: torch.dtype = torch.float32, act_dtype: torch.dtype = torch.float32) -> bool:
    return load(kv_dtype, act_dtype) is not None


def supports(q: torch.Tensor, cache: LayerKV) -> bool:
    """Whether ``paged_decode`` can run these tensors: CPU, float32 or bfloat16 queries (the
    output takes their dtype), contiguous pools of float32 / bfloat16 / float16 (both of one dtype)."""
    return (q.device.type == "cpu" and q.dtype in ACT_DTYPES and cache.k.dtype == cache.v.dtype
            and cache.k.dtype in KERNELS and cache.k.is_contiguous() and cache.v.is_contiguous()
            and available(cache.k.dtype, q.dtype))


def _rows(x: torch.Tensor, heads: int, dim: int) -> bool:
    # [T, heads, dim] with heads contiguous inside a token (any token stride)
    return (x.dim() == 3 and x.shape[1:] == (heads, dim) and x.stride(2) == 1
            and (heads == 1 or x.stride(1) == dim))


def supports_write(cache: LayerKV, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``write`` stores these rows: CPU contiguous pools of float32 / bfloat16 / float16
    (both of one dtype), k / v [T, Hkv, D] of one activation dtype (float32 or bfloat16) with each
    token's heads contiguous (a view of a fused projection's rows is), the kernel built. Rows of
    another dtype than the pool's are rounded to it as torch's ``copy_`` rounds (nearest even)."""
    hkv, _, dqk = cache.k.shape
    return (cache.k.device.type == "cpu" and k.device.type == "cpu" and cache.k.dtype == cache.v.dtype
            and cache.k.dtype in KERNELS and k.dtype in ACT_DTYPES and v.dtype == k.dtype
            and cache.k.is_contiguous() and cache.v.is_contiguous()
            and _rows(k, hkv, dqk) and _rows(v, hkv, cache.v.shape[2]) and k.shape[0] == v.shape[0]
            and available(cache.k.dtype, k.dtype))


def write(cache: LayerKV, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """``cache.write(slots, k, v)`` in one C pass (check ``supports_write`` first): slots [T] long."""
    hkv, num_slots, dqk = cache.k.shape
    slots = slots.to(torch.long).contiguous()
    t = k.shape[0]
    if slots.shape != (t,):
        raise ValueError(f"{tuple(slots.shape)} slots for {t} rows")
    if t == 0:
        return
    rc = load(cache.k.dtype, k.dtype).mmserve_paged_write_f32(cache.k.data_ptr(), cache.v.data_ptr(), num_slots, hkv, dqk, cache.v.shape[2],
                                        slots.data_ptr(), t, k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0))
    if rc != 0:
        raise IndexError(f"a KV slot outside the pool of {num_slots}")


def use_pool(par_for: int | None, threads: int) -> None:
    """Run every decode call on a C thread pool from now on: ``par_for`` is the address of its
    ``mmserve_par_for`` (``llm_svc.models.cpu_gemv.par_for_address``), ``threads`` how many of its
    threads may take part (the engine step's: ``StepThreads``). None or one thread: the calls go
    back to ``set_threads``' Python threads for long contexts only."""
    global _par_for, _par_threads
    _par_for, _par_threads = par_for, max(1, int(threads))


def pool() -> tuple[int | None, int]:
    """``use_pool``'s ``(par_for address or None, threads)``."""
    return _par_for, _par_threads


def thread_count() -> int:
    """The count ``set_threads`` gave (0: torch's)."""
    return _threads


def executor(n: int) -> ThreadPoolExecutor:
    """The attention kernels' thread pool, grown to at least ``n`` workers."""
    global _pool
    if _pool is None or _pool._max_workers < n:  # noqa: SLF001 (the pool's size is all we read)
        _pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="mmserve-attn")
    return _pool


def paged_decode(q: torch.Tensor, cache: LayerKV, table: torch.Tensor, trows: torch.Tensor,
                 k0: torch.Tensor | None, lens: torch.Tensor, params: AttentionParams,
                 threads: int | None = None) -> torch.Tensor:
    """One query per sequence over its context, read in place. q [B, Hq, Dqk] float32 or
    bfloat16 (the output's dtype; computed in float32 either way); sequence
    ``b`` reads positions ``k0[b] .. k0[b] + lens[b] - 1`` (``k0`` None: from 0) of row
    ``trows[b]`` of the slot table ``table [R, capacity]`` (long) -> [B, Hq, Dv]."""
    lib = load(cache.k.dtype, q.dtype)
    assert lib is not None and cache.v.dtype == cache.k.dtype, \
        "paged_decode called without the kernel (check supports() first)"
    b, hq, dqk = q.shape
    hkv, num_slots, dv = cache.v.shape
    assert hq % hkv == 0 and cache.k.shape == (hkv, num_slots, dqk), (q.shape, cache.k.shape, cache.v.shape)
    assert table.dtype == torch.long and table.dim() == 2 and table.is_contiguous()
    q = q.contiguous()
    trows, lens = trows.contiguous(), lens.contiguous()
    k0 = None if k0 is None else k0.contiguous()
    sinks = None if params.sinks is None else params.sinks.detach().float().contiguous()
    out = torch.empty(b, hq, dv, dtype=q.dtype)
    items = b * hkv
    args = (q.data_ptr(), cache.k.data_ptr(), cache.v.data_ptr(), table.data_ptr(), trows.data_ptr(),
            None if k0 is None else k0.data_ptr(), lens.data_ptr(),
            None if sinks is None else sinks.data_ptr(), out.data_ptr(),
            b, hq, hkv, dqk, dv, num_slots, table.shape[1], float(params.scale), float(params.softcap or 0.0))
    if threads is None and _par_for is not None and _par_threads > 1 and items > 1:
        # the pool's helpers are already awake in a decode step (its linears use them): a hop
        # costs microseconds, where a Python thread's cost ~50 us
        rc = lib.mmserve_paged_decode_pooled_f32(*args, _par_for, _par_threads, min(items, POOL_CHUNKS))
        assert rc == 0, "paged decode kernel: out of memory"
        return out
    n = min(threads or max(torch.get_num_threads(), _threads), items)
    if n > 1:  # (a small tensor's sum costs ~50 us here: only asked when a split is possible)
        n = max(1, min(n, int(lens.sum()) // MIN_SPLIT_KEYS))
    if n == 1:
        rc = lib.mmserve_paged_decode_f32(*args, 0, items)
        assert rc == 0, "paged decode kernel: out of memory"
        return out
    cuts = [items * i // n for i in range(n + 1)]
    futs = [executor(n).submit(lib.mmserve_paged_decode_f32, *args, cuts[i], cuts[i + 1]) for i in range(n)]
    assert all(f.result() == 0 for f in futs), "paged decode kernel: out of memory"
    return out
