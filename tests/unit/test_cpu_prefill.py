"""The CPU paged prefill kernel (``cpu_prefill.c``) against a plain reference (each query's
visible keys gathered and soft-maxed in float64): GQA groups from 1 to 8, sinks, qk != v, chunks
with and without earlier context, sliding windows (smaller and larger than the chunk), padded
members, query blocks that end mid-tile, scattered slots, and calls split over threads."""

from __future__ import annotations

import pytest
import torch

from llm_svc.attention import AttentionParams, LayerKV
from llm_svc.attention import cpu_prefill

pytestmark = pytest.mark.unit


def test_kernel_builds_here():
    """The machine (and CI) has a C compiler: the kernel, not the fallback, is what runs, for
    each pool dtype it reads."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert cpu_prefill.available(dtype)


def _case(g, hq, hkv, dqk, dv, members, window):
    """members: (queries, first query position, first readable key position) each."""
    cap = max(p + n for n, p, _ in members) + 40
    rows = len(members) + 2
    num_slots = rows * cap + 11
    cache = LayerKV(torch.randn(hkv, num_slots, dqk, generator=g), torch.randn(hkv, num_slots, dv, generator=g))
    table = torch.randperm(num_slots, generator=g)[: rows * cap].view(rows, cap).contiguous()
    trows = torch.randperm(rows, generator=g)[: len(members)]
    nq = max(n for n, _, _ in members)
    q = torch.randn(len(members), nq, hq, dqk, generator=g)
    ns = torch.tensor([n for n, _, _ in members])
    qpos0 = torch.tensor([p for _, p, _ in members])
    k0 = torch.tensor([k for _, _, k in members])
    return q, cache, table, trows, k0, qpos0, ns


def _reference(q, cache, table, trows, k0, qpos0, ns, window, params):
    b, nq, hq, _ = q.shape
    hkv, _, dv = cache.v.shape
    g = hq // hkv
    out = torch.zeros(b, nq, hq, dv, dtype=torch.float64)
    for j in range(b):
        for i in range(int(ns[j])):
            p = int(qpos0[j]) + i
            lo = int(k0[j]) if window is None else max(int(k0[j]), p - window + 1)
            slots = table[trows[j], lo:p + 1]
            for h in range(hq):
                k = cache.k[h // g, slots].double()
                v = cache.v[h // g, slots].double()
                s = (k @ q[j, i, h].double()) * params.scale
                if params.sinks is not None:
                    s = torch.cat([s, params.sinks[h].double().view(1)])
                pr = torch.softmax(s, 0)[: len(slots)]
                out[j, i, h] = pr @ v
    return out.float()


@pytest.mark.parametrize("hq,hkv,dqk,dv", [(8, 4, 96, 96), (4, 4, 64, 64), (8, 1, 32, 48), (6, 2, 40, 24),
                                           (16, 2, 128, 128)])
@pytest.mark.parametrize("sinks", [False, True])
def test_full_layer_chunks(hq, hkv, dqk, dv, sinks):
    """Full layers: chunks alone and after earlier context, one padded member, blocks mid-tile."""
    g = torch.Generator().manual_seed(hq * 131 + dqk + sinks)
    members = [(70, 0, 0), (37, 150, 0), (1, 9, 0), (130, 64, 0)]
    q, cache, table, trows, k0, qpos0, ns = _case(g, hq, hkv, dqk, dv, members, None)
    params = AttentionParams(scale=dqk ** -0.5, sinks=torch.randn(hq, generator=g) if sinks else None)
    got = cpu_prefill.paged_prefill(q, cache, table, trows, k0, qpos0, ns, None, params)
    want = _reference(q, cache, table, trows, k0, qpos0, ns, None, params)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), (got - want).abs().max()
    for j, n in enumerate(ns.tolist()):
        assert not got[j, n:].any(), "padded query rows are zeros"


@pytest.mark.parametrize("window", [16, 100, 300])
@pytest.mark.parametrize("sinks", [False, True])
def test_sliding_windows(window, sinks):
    """Sliding layers: keys from ``max(k0, p - W + 1)``; windows shorter than a tile, about a
    chunk, and longer than the context; a member whose readable keys start past 0."""
    g = torch.Generator().manual_seed(window + sinks)
    hq, hkv, d = 8, 4, 64
    members = [(200, 0, 0), (45, 500, 500 - window + 1 if window < 500 else 0), (90, 260, 120)]
    q, cache, table, trows, k0, qpos0, ns = _case(g, hq, hkv, d, d, members, window)
    params = AttentionParams(scale=d ** -0.5, sinks=torch.randn(hq, generator=g) if sinks else None)
    got = cpu_prefill.paged_prefill(q, cache, table, trows, k0, qpos0, ns, window, params)
    want = _reference(q, cache, table, trows, k0, qpos0, ns, window, params)
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), (got - want).abs().max()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_give_the_same_result(threads):
    """Items go round-robin over threads: any count gives the one-thread result bit for bit."""
    g = torch.Generator().manual_seed(5)
    members = [(300, 400, 0), (250, 0, 0)]
    q, cache, table, trows, k0, qpos0, ns = _case(g, 8, 4, 96, 96, members, None)
    params = AttentionParams(scale=0.1, sinks=torch.randn(8, generator=g))
    one = cpu_prefill.paged_prefill(q, cache, table, trows, k0, qpos0, ns, None, params, threads=1)
    many = cpu_prefill.paged_prefill(q, cache, table, trows, k0, qpos0, ns, None, params, threads=threads)
    assert torch.equal(one, many)


def test_extreme_scores_stay_finite():
    """Large logits (a sharp softmax) and a row whose first key block is all masked (window edge,
    no sinks) give the reference's answer, no NaN."""
    g = torch.Generator().manual_seed(9)
    members = [(128, 300, 0)]
    q, cache, table, trows, k0, qpos0, ns = _case(g, 4, 2, 32, 32, members, 20)
    q = q * 30
    params = AttentionParams(scale=1.0)
    got = cpu_prefill.paged_prefill(q, cache, table, trows, k0, qpos0, ns, 20, params)
    want = _reference(q, cache, table, trows, k0, qpos0, ns, 20, params)
    assert torch.isfinite(got).all()
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-3), (got - want).abs().max()


@pytest.mark.parametrize("tiling", [("-DMV=4", "-DJR=6", "-DDR=6"), ("-DMV=8", "-DJR=3", "-DDR=3"),
                                    ("-DMV=4", "-DJR=2", "-DDR=2"), ("-DVW=8", "-DMV=8", "-DJR=3", "-DDR=3"),
                                    ("-DVW=16", "-DMV=4", "-DJR=6", "-DDR=6"), ("-DVW=16", "-DMV=2", "-DJR=5", "-DDR=5")])
def test_other_tilings_agree(tiling, monkeypatch):
    """The register tilings the machines build (8 wide: 64 rows x 3 keys / 3 value columns on
    AVX-512 Zen 4; 16 wide: 64 rows x 6 / 6 on other AVX-512 CPUs) and others, built here too
    (16-wide vectors run as two halves on an AVX2 machine): same answers as the reference,
    remainders included (odd key counts, head dims not a multiple of 6 or 3, the 4-column tail)."""
    from llm_svc.kernels.ckernels import FAST_FLAGS, CKernel

    lib = CKernel(cpu_prefill.SOURCE, "cpu_prefill_t" + "".join(t[-1] for t in tiling), cpu_prefill._bind,
                  what="test tiling", fallback="none", flags=FAST_FLAGS + tiling,
                  headers=cpu_prefill.KERNEL.headers).load()
    assert lib is not None
    monkeypatch.setattr(cpu_prefill, "load", lambda *_: lib)
    g = torch.Generator().manual_seed(21)
    for window, hq, hkv, dqk, dv in ((None, 8, 4, 96, 80), (37, 6, 2, 40, 29)):
        members = [(70, 0, 0), (53, 101, 0 if window is None else 101 - window + 1)]
        q, cache, table, trows, k0, qpos0, ns = _case(g, hq, hkv, dqk, dv, members, window)
        params = AttentionParams(scale=dqk ** -0.5, sinks=torch.randn(hq, generator=g))
        got = cpu_prefill.paged_prefill(q, cache, table, trows, k0, qpos0, ns, window, params, threads=2)
        want = _reference(q, cache, table, trows, k0, qpos0, ns, window, params)
        assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), (got - want).abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 50])
def test_half_precision_pools(dtype, window):
    """bfloat16 / float16 pools (one build each): each K / V element widened to float32 as read,
    the same answer as the reference over the same (rounded) pool values."""
    g = torch.Generator().manual_seed(31)
    members = [(90, 0, 0), (41, 130, 0 if window is None else 130 - window + 1)]
    q, cache, table, trows, k0, qpos0, ns = _case(g, 8, 2, 64, 48, members, window)
    cache = LayerKV(cache.k.to(dtype), cache.v.to(dtype))
    params = AttentionParams(scale=0.125, sinks=torch.randn(8, generator=g))
    assert cpu_prefill.supports(q, cache, params)
    got = cpu_prefill.paged_prefill(q, cache, table, trows, k0, qpos0, ns, window, params)
    want = _reference(q, cache, table, trows, k0, qpos0, ns, window, params)
    assert got.dtype == torch.float32
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), (got - want).abs().max()


@pytest.fixture
def c_pool():
    """The engine core's setting (``StepThreads``): attention calls run on the few-row kernel's
    C pool, caller included, on ``n`` threads; reset afterwards."""
    from llm_svc.attention import cpu_paged
    from llm_svc.models import cpu_gemv

    def use(n: int) -> None:
        cpu_gemv.set_threads(n)
        cpu_paged.use_pool(cpu_gemv.par_for_address(), n)

    yield use
    cpu_paged.use_pool(None, 1)
    cpu_gemv.set_threads(1)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("dtype,window", [(torch.float32, None), (torch.float32, 70), (torch.bfloat16, 70),
                                          (torch.float16, None)])
def test_items_on_the_c_pool_give_the_one_thread_result(c_pool, threads, dtype, window):
    """Each item one chunk of the C pool (the caller from the front, helpers from the back):
    bit for bit the one-thread result, for every pool dtype's build, causal and sliding, members
    of unequal length with a block that ends mid-tile."""
    from llm_svc.models import cpu_gemv

    g = torch.Generator().manual_seed(41)
    members = [(300, 400, 0 if window is None else 400 - window + 1), (37, 0, 0), (250, 90, 0)]
    q, cache, table, trows, k0, qpos0, ns = _case(g, 8, 2, 64, 48, members, window)
    cache = LayerKV(cache.k.to(dtype), cache.v.to(dtype))
    params = AttentionParams(scale=0.125, sinks=torch.randn(8, generator=g))
    one = cpu_prefill.paged_prefill(q, cache, table, trows, k0, qpos0, ns, window, params, threads=1)
    c_pool(threads)
    for _ in range(3):  # several generations of the pool's jobs
        pooled = cpu_prefill.paged_prefill(q, cache, table, trows, k0, qpos0, ns, window, params)
        assert torch.equal(pooled, one)
    assert cpu_gemv.KERNEL.load().mmserve_pool_helpers() >= threads - 1  # the helpers did start


def test_more_query_heads_per_kv_head_than_a_tile_holds_are_left_to_torch():
    rows = cpu_prefill.tile_rows()
    assert rows == 64
    params = AttentionParams(scale=0.125)
    cache = LayerKV.empty(16, 1, 8, 8, torch.float32)
    assert cpu_prefill.supports(torch.randn(1, 4, rows, 8), cache, params)
    assert not cpu_prefill.supports(torch.randn(1, 4, rows + 1, 8), cache, params)
