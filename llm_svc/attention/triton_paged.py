"""``triton_paged``: a paged attention Triton kernel reading K/V in place from the slot pool.

Every query row sees one contiguous range of key positions ``[lo, hi]`` (``paged_rows``), and
positions map to pool slots through its sequence's slot-table row. One program per (row block,
kv head): a block is up to ``BLOCK_M`` consecutive query rows of ONE sequence (a decode is a
block of one row), and all ``G = Hq // Hkv`` query heads of the kv head go together, so the
score tile is ``[BLOCK_M * G, BLOCK_N]`` (GQA without repeating K/V). The program loops over
key blocks of ``BLOCK_N`` positions from the block's smallest ``lo`` to its largest ``hi``,
loads their slot ids from the table row, gathers those K/V rows from the pool (the context is
never copied out), masks each row to its own ``[lo, hi]`` and keeps an online softmax in
float32. MiMo's sinks are the softmax's starting state (running max ``sink[h]``, mass 1, no
value): exactly the extra logit column of ``torch_common.attend``. Optional soft-cap (tanh).
Head dims need not be powers of two nor equal (MiMo: qk 192 / v 128): tiles are padded to
powers of two and masked.

Two launches per layer: single-row blocks (decodes, with the head tile padded to 16 rows for
``tl.dot``) and multi-row blocks (prefill chunks, ``BLOCK_M * G`` about 64).

Triton is imported lazily (the first kernel call), so importing this module, and registering
the backend, works without triton; ``TRITON_INTERPRET=1`` is honoured when the kernel is first
built (one kernel object per mode), which is how the tests run it on CPU tensors. On a CPU
without the interpreter the backend falls back to ``paged_ref`` (same semantics, plain torch).

Not done (yet): split-K over long contexts for decode batches with few sequences (one program
per (sequence, kv head) walks the whole context), fp8 KV.
"""

from __future__ import annotations

import os

import torch

from llm_svc.types.request import ForwardBatch
from llm_svc.attention.slot_tables import StepTables

from . import ATTENTION_BACKENDS
from .base import AttentionBackend, AttentionParams, LayerKV
from .paged_ref import paged_attention_ref
from .paged_rows import RowRanges, row_ranges

_KERNELS: dict[bool, tuple] = {}


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")  # as triton reads it


def _kernel():
    """The jitted kernel, built at first use (triton's ``jit`` reads ``TRITON_INTERPRET`` when
    it decorates, so one kernel per mode). The compiled kernel finds its helper as a closure
    variable; the interpreter re-executes the kernel's source in this module's globals, so
    there the helper of the interpreted mode is bound as the module global ``_key_block``."""
    mode = _interpret()
    built = _KERNELS.get(mode)
    if built is None:
        built = _KERNELS[mode] = _build_kernel()
    kernel, helper = built
    if mode:
        globals()["_key_block"] = helper
    return kernel


def _build_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _key_block(q, m_i, l_i, acc, start, lo, hi, hi_max, t_base, k_base, v_base,
                   stride_tc, stride_ks, stride_kd, stride_vs, stride_vd, scale, softcap,
                   D: tl.constexpr, DV: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr,
                   BLOCK_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
        """Keys at positions ``start .. start + BLOCK_N - 1`` (<= hi_max) into the online softmax."""
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, DP)
        offs_dv = tl.arange(0, DVP)
        pos = start + offs_n
        n_ok = pos <= hi_max
        slot = tl.load(t_base + pos * stride_tc, mask=n_ok, other=0).to(tl.int64)
        kt = tl.load(k_base + slot[None, :] * stride_ks + offs_d[:, None] * stride_kd,
                     mask=n_ok[None, :] & (offs_d[:, None] < D), other=0.0).to(q.dtype)  # [DP, BLOCK_N]
        if IEEE:
            s = tl.dot(q, kt, input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        s = s * scale
        if HAS_SOFTCAP:  # softcap * tanh(s / softcap); tanh(x) = sign(x) (1 - e^-2|x|) / (1 + e^-2|x|)
            x = s / softcap
            e = tl.exp(-2.0 * tl.abs(x))
            th = (1.0 - e) / (1.0 + e)
            s = tl.where(x < 0, -th, th) * softcap
        ok = (pos[None, :] >= lo[:, None]) & (pos[None, :] <= hi[:, None])
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + slot[:, None] * stride_vs + offs_dv[None, :] * stride_vd,
                    mask=n_ok[:, None] & (offs_dv[None, :] < DV), other=0.0).to(q.dtype)  # [BLOCK_N, DVP]
        if IEEE:
            pv = tl.dot(p.to(q.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v)
        acc = acc * alpha[:, None] + pv
        return m_new, l_i, acc

    @triton.jit
    def _paged_attn_kernel(
        Q, K, V, O, TABLE, SINKS, BLK_ROW0, BLK_N, LO, HI, TROW,
        stride_qt, stride_qh, stride_qd,
        stride_kh, stride_ks, stride_kd,
        stride_vh, stride_vs, stride_vd,
        stride_ot, stride_oh, stride_od,
        stride_tr, stride_tc,
        scale, softcap,
        G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
        BLOCK_M: tl.constexpr, GP: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_SINKS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
    ):
        blk = tl.program_id(0)
        kvh = tl.program_id(1).to(tl.int64)  # 64-bit offsets: kvh * stride_kh may pass 2^31
        row0 = tl.load(BLK_ROW0 + blk).to(tl.int64)
        nrows = tl.load(BLK_N + blk)
        M: tl.constexpr = BLOCK_M * GP
        offs_m = tl.arange(0, M)
        r = offs_m // GP  # tile row -> (query row of the block, query head of the group)
        g = offs_m % GP
        row_ok = r < nrows
        m_ok = row_ok & (g < G)
        rows = row0 + r
        heads = kvh * G + g
        lo = tl.load(LO + rows, mask=row_ok, other=2147483647)
        hi = tl.load(HI + rows, mask=row_ok, other=-1)
        lo_min = tl.min(lo, axis=0)
        hi_max = tl.max(hi, axis=0)
        trow = tl.load(TROW + row0).to(tl.int64)
        offs_d = tl.arange(0, DP)
        offs_dv = tl.arange(0, DVP)
        q = tl.load(Q + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                    mask=m_ok[:, None] & (offs_d[None, :] < D), other=0.0)
        if HAS_SINKS:  # the sink is the softmax's first logit: max sink[h], mass exp(0) = 1, no value
            m_i = tl.load(SINKS + heads, mask=m_ok, other=0.0).to(tl.float32)
            l_i = tl.full([M], 1.0, dtype=tl.float32)
        else:
            m_i = tl.full([M], -1.0e30, dtype=tl.float32)  # finite: exp(m_i - m_new) is never NaN
            l_i = tl.zeros([M], dtype=tl.float32)
        acc = tl.zeros([M, DVP], dtype=tl.float32)
        k_base = K + kvh * stride_kh
        v_base = V + kvh * stride_vh
        t_base = TABLE + trow * stride_tr
        if INTERPRET:  # the interpreter cannot take tensor bounds in range(): same loop as a while
            start = lo_min
            while start <= hi_max:
                m_i, l_i, acc = _key_block(q, m_i, l_i, acc, start, lo, hi, hi_max, t_base, k_base, v_base,
                                           stride_tc, stride_ks, stride_kd, stride_vs, stride_vd, scale, softcap,
                                           D, DV, DP, DVP, BLOCK_N, HAS_SOFTCAP, IEEE)
                start += BLOCK_N
        else:
            for start in range(lo_min, hi_max + 1, BLOCK_N):
                m_i, l_i, acc = _key_block(q, m_i, l_i, acc, start, lo, hi, hi_max, t_base, k_base, v_base,
                                           stride_tc, stride_ks, stride_kd, stride_vs, stride_vd, scale, softcap,
                                           D, DV, DP, DVP, BLOCK_N, HAS_SOFTCAP, IEEE)
        l_i = tl.where(l_i > 0, l_i, 1.0)  # only padded tile rows (never stored) have no mass
        out = acc / l_i[:, None]
        tl.store(O + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_dv[None, :] * stride_od,
                 out.to(O.dtype.element_ty), mask=m_ok[:, None] & (offs_dv[None, :] < DV))

    return _paged_attn_kernel, _key_block


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def paged_attention_triton(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, ranges: RowRanges,
                           scale: float, sinks: torch.Tensor | None = None, softcap: float | None = None,
                           block_n: int | None = None, tile_m: int = 64) -> torch.Tensor:
    """Same contract as ``paged_ref.paged_attention_ref``: q [T, Hq, Dqk], pools
    ``[Hkv, S, D]`` -> [T, Hq, Dv] in q's dtype. ``block_n``: keys per loop step (default 64,
    32 for head dims > 128); ``tile_m``: target query-tile rows (rows x heads) of prefill blocks."""
    t, hq, d = q.shape
    hkv, _, dv = v_pool.shape
    assert k_pool.shape[0] == hkv and k_pool.shape[2] == d and hq % hkv == 0, (q.shape, k_pool.shape, v_pool.shape)
    g = hq // hkv
    out = q.new_empty(t, hq, dv)
    if t == 0:
        return out
    kern, interp = _kernel(), _interpret()
    gp = _pow2(g)
    dp, dvp = max(16, _pow2(d)), max(16, _pow2(dv))
    bn = block_n or (64 if max(dp, dvp) <= 128 else 32)
    table = ranges.table
    sink_arg = sinks.to(device=q.device, dtype=torch.float32).contiguous() if sinks is not None else ranges.lo
    ieee = q.dtype == torch.float32
    for multi in (False, True):
        if multi:
            block_m = max(1, tile_m // gp)
            head_pad = gp
        else:
            block_m, head_pad = 1, max(16, gp)  # tl.dot wants >= 16 tile rows
        row0, nrows = ranges.blocks(block_m, multi)
        nb = int(row0.shape[0])
        if nb == 0:
            continue
        m = block_m * head_pad
        kern[(nb, hkv)](
            q, k_pool, v_pool, out, table, sink_arg, row0, nrows, ranges.lo, ranges.hi, ranges.trow,
            q.stride(0), q.stride(1), q.stride(2),
            k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
            v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            table.stride(0), table.stride(1),
            float(scale), float(softcap) if softcap is not None else 1.0,
            G=g, D=d, DV=dv, BLOCK_M=block_m, GP=head_pad, DP=dp, DVP=dvp, BLOCK_N=bn,
            HAS_SINKS=sinks is not None, HAS_SOFTCAP=softcap is not None, IEEE=ieee, INTERPRET=interp,
            num_warps=8 if m * max(dp, dvp) >= 128 * 128 else 4,
        )
    return out


@ATTENTION_BACKENDS.register("triton_paged")
class TritonPagedAttention(AttentionBackend):
    """``prepare``: per-row key ranges (``paged_rows.row_ranges``); ``forward``: write the new
    K/V, then the paged kernel over the pool (``paged_ref`` on a CPU without the interpreter)."""

    name = "triton_paged"

    def prepare(self, batch: ForwardBatch, tables: StepTables, window: int,
                device: torch.device) -> dict[str, RowRanges]:
        return row_ranges(batch, tables, window, device)

    def forward(self, kind, q, k, v, cache: LayerKV, meta: dict[str, RowRanges],
                params: AttentionParams) -> torch.Tensor:
        rr = meta[kind]
        cache.write(rr.out_slots, k, v)
        fn = paged_attention_triton if (q.is_cuda or _interpret()) else paged_attention_ref
        return fn(q, cache.k, cache.v, rr, params.scale, params.sinks, params.softcap)
