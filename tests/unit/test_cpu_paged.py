"""The CPU paged decode kernel (``cpu_paged.c``) against the torch reference (gather + ``attend``):
GQA, sinks, soft-cap, qk != v, contexts from 1 key to several kernel blocks, sliding contexts that
start past 0 (``k0``), table rows out of order, scattered slots, the specialised head dims and the
generic body, and a step split over threads."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from llm_svc.kernels.ckernels import CKernel
from llm_svc.attention import AttentionParams, LayerKV
from llm_svc.attention import cpu_paged
from llm_svc.attention.torch_common import attend, table_slots

pytestmark = pytest.mark.unit


def test_kernel_builds_here():
    """The machine (and CI) has a C compiler: the kernel, not the fallback, is what runs."""
    assert cpu_paged.available()
    assert cpu_paged.library_path().exists()


def test_loading_keeps_the_process_float_state():
    """The kernel is compiled with -ffast-math but must not set flush-to-zero / denormals-are-zero
    for the process (gcc's crtfastmath.o does, if linked in): subnormals survive after loading."""
    code = ("from llm_svc.attention import cpu_paged; assert cpu_paged.available(); "
            "import torch; x = 5e-324; assert x * 1.5 > 0.0, 'FTZ/DAZ set'; "
            "t = torch.tensor([1e-40]); assert float((t * 1.0)[0]) > 0.0, 'float32 subnormal flushed'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def _case(g: torch.Generator, b: int, hq: int, hkv: int, dqk: int, dv: int, lens: list[int],
          sliding: bool, scattered: bool):
    cap = max(lens) + 64
    rows = b + 2  # the table holds more rows than the step reads, in another order
    num_slots = rows * cap + 7
    cache = LayerKV(torch.randn(hkv, num_slots, dqk, generator=g), torch.randn(hkv, num_slots, dv, generator=g))
    perm = torch.randperm(num_slots, generator=g) if scattered else torch.arange(num_slots)
    table = perm[: rows * cap].view(rows, cap).contiguous()
    trows = torch.randperm(rows, generator=g)[:b]
    lens_t = torch.tensor(lens)
    k0 = torch.randint(0, 60, (b,), generator=g) if sliding else None
    q = torch.randn(b, hq, dqk, generator=g)
    return q, cache, table, trows, k0, lens_t


def _reference(q, cache, table, trows, k0, lens, params):
    L = int(lens.max())
    ctx = table_slots(table, trows, k0, lens, L)  # [B, L]
    k, v = cache.gather(ctx, torch.float32)
    pad = torch.arange(L)[None, :] >= lens[:, None]
    bias = torch.zeros(pad.shape).masked_fill_(pad, float("-inf"))[:, None, :]
    return attend(q.unsqueeze(1), k, v, bias, params).squeeze(1)


@pytest.mark.parametrize("dims", [(24, 16), (96, 96), (64, 64), (192, 128), (40, 40), (8, 6)])
@pytest.mark.parametrize("variant", ["plain", "sinks", "softcap"])
def test_kernel_matches_reference(dims, variant):
    dqk, dv = dims
    g = torch.Generator().manual_seed(dqk * 31 + dv + len(variant))
    hq, hkv = 8, 2
    lens = [1, 2, 7, 511, 512, 513, 1300]
    q, cache, table, trows, k0, lens_t = _case(g, len(lens), hq, hkv, dqk, dv, lens,
                                               sliding=variant != "plain", scattered=variant == "sinks")
    params = AttentionParams(scale=dqk ** -0.5,
                             sinks=torch.randn(hq, generator=g) if variant == "sinks" else None,
                             softcap=20.0 if variant == "softcap" else None)
    got = cpu_paged.paged_decode(q, cache, table, trows, k0, lens_t, params)
    want = _reference(q, cache, table, trows, k0, lens_t, params)
    assert got.shape == (len(lens), hq, dv)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (1, 1)])
def test_kernel_head_groupings(hq, hkv):
    g = torch.Generator().manual_seed(hq * 10 + hkv)
    lens = [5, 300, 77]
    q, cache, table, trows, k0, lens_t = _case(g, 3, hq, hkv, 32, 32, lens, sliding=False, scattered=True)
    params = AttentionParams(scale=0.2)
    torch.testing.assert_close(cpu_paged.paged_decode(q, cache, table, trows, k0, lens_t, params),
                               _reference(q, cache, table, trows, k0, lens_t, params), rtol=1e-4, atol=1e-5)


def test_split_over_threads_equals_one_thread(monkeypatch):
    """A step with enough keys runs on several Python threads (ranges of work items): same result."""
    monkeypatch.setattr(cpu_paged, "MIN_SPLIT_KEYS", 64)
    g = torch.Generator().manual_seed(5)
    lens = [700, 33, 1025, 260, 9]
    q, cache, table, trows, k0, lens_t = _case(g, 5, 4, 2, 16, 16, lens, sliding=True, scattered=True)
    params = AttentionParams(scale=0.25, sinks=torch.randn(4, generator=g))
    one = cpu_paged.paged_decode(q, cache, table, trows, k0, lens_t, params, threads=1)
    three = cpu_paged.paged_decode(q, cache, table, trows, k0, lens_t, params, threads=3)
    torch.testing.assert_close(three, one, rtol=0, atol=0)
    torch.testing.assert_close(one, _reference(q, cache, table, trows, k0, lens_t, params), rtol=1e-4, atol=1e-5)


def test_set_threads_splits_a_long_decode_while_torch_runs_on_one(monkeypatch):
    """The engine core's setting: a decode step (torch on one thread) with enough keys still
    splits its attention over ``set_threads`` Python threads, with the same result."""
    monkeypatch.setattr(cpu_paged, "MIN_SPLIT_KEYS", 64)
    monkeypatch.setattr(cpu_paged, "_threads", 0)
    calls = []
    real = cpu_paged.executor
    monkeypatch.setattr(cpu_paged, "executor", lambda n: calls.append(n) or real(n))
    g = torch.Generator().manual_seed(6)
    q, cache, table, trows, k0, lens_t = _case(g, 4, 4, 2, 16, 16, [400, 90, 513, 70], sliding=False, scattered=True)
    params = AttentionParams(scale=0.25)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = cpu_paged.paged_decode(q, cache, table, trows, k0, lens_t, params)
        assert calls == []  # torch's one thread and no setting: no split
        cpu_paged.set_threads(2)
        two = cpu_paged.paged_decode(q, cache, table, trows, k0, lens_t, params)
    finally:
        torch.set_num_threads(n)
    assert set(calls) == {2}  # split over two threads
    torch.testing.assert_close(two, one, rtol=0, atol=0)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dims", [(96, 96), (192, 128), (40, 40), (8, 6)])
def test_low_precision_pools_match_the_reference(kv_dtype, dims):
    """bfloat16 / float16 pools (their own builds): each K / V element widened to float32 as it is
    loaded, so the result is the float32 computation over the pool's values."""
    dqk, dv = dims
    g = torch.Generator().manual_seed(dqk + dv)
    hq, hkv = 8, 2
    lens = [1, 9, 513, 1300]
    q, cache, table, trows, k0, lens_t = _case(g, len(lens), hq, hkv, dqk, dv, lens, sliding=True, scattered=True)
    c32, cache = cache, LayerKV(cache.k.to(kv_dtype), cache.v.to(kv_dtype))
    params = AttentionParams(scale=dqk ** -0.5, sinks=torch.randn(hq, generator=g))
    assert cpu_paged.supports(q, cache)
    got = cpu_paged.paged_decode(q, cache, table, trows, k0, lens_t, params)
    torch.testing.assert_close(got, _reference(q, cache, table, trows, k0, lens_t, params), rtol=1e-4, atol=1e-5)
    # the values read are the rounded ones: the float32 pool they came from gives another result
    assert float((cpu_paged.paged_decode(q, c32, table, trows, k0, lens_t, params) - got).abs().max()) > 1e-4


def test_supports_only_cpu_float_contiguous():
    cache = LayerKV.empty(16, 2, 8, 8, torch.float32)
    q = torch.randn(1, 2, 8)
    assert cpu_paged.supports(q, cache)
    assert not cpu_paged.supports(q.double(), cache)
    assert cpu_paged.supports(q, LayerKV.empty(16, 2, 8, 8, torch.bfloat16))
    assert not cpu_paged.supports(q, LayerKV(torch.zeros(2, 16, 8, dtype=torch.bfloat16), torch.zeros(2, 16, 8)))
    assert not cpu_paged.supports(q, LayerKV.empty(16, 2, 8, 8, torch.float64))
    assert not cpu_paged.supports(q, LayerKV(cache.k.transpose(0, 1).contiguous().transpose(0, 1), cache.v))


def test_no_compiler_falls_back(monkeypatch, tmp_path, caplog):
    """No compiler and no cached build: ``available()`` is False with a warning, nothing raises."""
    monkeypatch.setenv("MMSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(cpu_paged, "KERNEL", CKernel(cpu_paged.SOURCE, "cpu_paged", cpu_paged._bind,
                                                     what="CPU paged decode kernel", fallback="gather"))
    with caplog.at_level("WARNING"):
        assert cpu_paged.load() is None
    assert "unavailable" in caplog.text
    assert not cpu_paged.supports(torch.randn(1, 2, 8), LayerKV.empty(16, 2, 8, 8, torch.float32))


def test_a_header_the_source_includes_is_part_of_the_build_key(tmp_path, monkeypatch):
    """Both KV kernels include kv_elem.h: editing it must rebuild them, not load a stale build."""
    monkeypatch.setenv("MMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    src, hdr = tmp_path / "k.c", tmp_path / "k.h"
    src.write_text('#include "k.h"\nint f(void) { return K; }\n')
    hdr.write_text("#define K 1\n")
    k = CKernel(src, "k", lambda lib: None, what="k", fallback="none", headers=(hdr,))
    before = k.library_path()
    hdr.write_text("#define K 2\n")
    assert k.library_path() != before
    assert cpu_paged.KERNEL.headers == (cpu_paged.SOURCE.with_name("kv_elem.h"), cpu_paged.SOURCE.with_name("act_elem.h"))
    assert all(b.headers == cpu_paged.KERNEL.headers for b in cpu_paged.ACT_KERNELS.values())


@pytest.mark.parametrize("threads", [2, 4])
def test_decode_on_the_c_pool_equals_one_thread(threads):
    """``use_pool`` (the engine core's decode steps, ``StepThreads``): every call, however short,
    runs its (sequence, kv head) items on the few-row kernel's C pool, caller included, and gives
    the one-thread result bit for bit; ``use_pool(None, ..)`` goes back to the Python threads."""
    from llm_svc.models import cpu_gemv

    g = torch.Generator().manual_seed(8)
    lens = [700, 1, 1025, 260, 9, 64]
    q, cache, table, trows, k0, lens_t = _case(g, 6, 8, 4, 64, 64, lens, sliding=True, scattered=True)
    params = AttentionParams(scale=0.125, sinks=torch.randn(8, generator=g))
    one = cpu_paged.paged_decode(q, cache, table, trows, k0, lens_t, params, threads=1)
    cpu_gemv.set_threads(threads)
    cpu_paged.use_pool(cpu_gemv.par_for_address(), threads)
    try:
        assert cpu_paged.pool() == (cpu_gemv.par_for_address(), threads)
        for _ in range(3):
            assert torch.equal(cpu_paged.paged_decode(q, cache, table, trows, k0, lens_t, params), one)
        assert cpu_gemv.KERNEL.load().mmserve_pool_helpers() >= threads - 1
    finally:
        cpu_paged.use_pool(None, 1)
        cpu_gemv.set_threads(1)
    assert cpu_paged.pool() == (None, 1)
    torch.testing.assert_close(one, _reference(q, cache, table, trows, k0, lens_t, params), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("hkv,dqk,dv", [(2, 96, 96), (4, 24, 16), (1, 8, 8)])
def test_write_stores_what_layer_kv_write_stores(hkv, dqk, dv):
    """The C write equals ``LayerKV.write`` for rows that are views of a fused projection (token
    stride wider than the heads), scattered and out-of-order slots; a slot off the pool is refused
    before anything is written."""
    g = torch.Generator().manual_seed(hkv * 100 + dqk)
    want, got = (LayerKV.empty(50, hkv, dqk, dv, torch.float32) for _ in range(2))
    for cache in (want, got):  # what is already there stays
        cache.k.copy_(torch.arange(cache.k.numel(), dtype=torch.float32).view_as(cache.k))
        cache.v.copy_(-torch.arange(cache.v.numel(), dtype=torch.float32).view_as(cache.v))
    rows = torch.randn(7, 3 + hkv * (dqk + dv) + 5, generator=g)  # [T, q | k | v | more], as a fused qkv buffer
    k = rows[:, 3:3 + hkv * dqk].view(7, hkv, dqk)
    v = rows[:, 3 + hkv * dqk:3 + hkv * (dqk + dv)].view(7, hkv, dv)
    slots = torch.tensor([31, 2, 49, 0, 17, 18, 5])
    assert cpu_paged.supports_write(got, k, v)
    want.write(slots, k, v)
    cpu_paged.write(got, slots, k, v)
    assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
    before = got.k.clone()
    with pytest.raises(IndexError, match="outside the pool"):
        cpu_paged.write(got, torch.tensor([1, 2, 3, 4, 5, 6, 50]), k, v)
    assert torch.equal(got.k, before)
    cpu_paged.write(got, torch.empty(0, dtype=torch.long), k[:0], v[:0])  # nothing to write
    assert torch.equal(got.k, before)


def test_write_is_not_taken_for_rows_it_cannot_read():
    cache = LayerKV.empty(8, 2, 4, 4, torch.float32)
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    assert cpu_paged.supports_write(cache, k, v)
    assert not cpu_paged.supports_write(cache, k.transpose(0, 1).contiguous().transpose(0, 1), v)  # heads strided
    assert not cpu_paged.supports_write(cache, k.double(), v)
    assert not cpu_paged.supports_write(cache, k.half(), v.half())  # float16 activations: no build
    assert not cpu_paged.supports_write(cache, k.bfloat16(), v)  # k and v of two dtypes
    # pools of another dtype than the rows: rounded as written (tests/unit/test_bf16_kernels.py)
    assert cpu_paged.supports_write(LayerKV.empty(8, 2, 4, 4, torch.bfloat16), k, v)
