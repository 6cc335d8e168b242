"""Batched attention (padded buckets, query blocks) vs the one-chunk-at-a-time reference backend
on random steps: prefill chunks of different lengths mixed with decodes, full and sliding
layers, GQA, sinks, soft-cap, Gemma 3 bidirectional image spans; plus the padding bounds."""

from __future__ import annotations

import random

import pytest
import torch

from llm_svc.attention import FULL, SLIDING, AttentionParams, LayerKV, create_attention_backend
from llm_svc.attention.torch_batched import BucketPolicy, TorchBatchedAttention, plan_buckets
from llm_svc.types.request import ForwardBatch, SeqForward
from llm_svc.attention.slot_tables import DeviceSlotTables

pytestmark = pytest.mark.unit
HQ, D, DV = 4, 8, 6


def random_step(rng: random.Random, window: int, num_seqs: int, num_full: int, num_swa: int,
                spans: bool) -> ForwardBatch:
    """A step of ``num_seqs`` sequences (about half decodes) over shuffled, disjoint slots."""
    free_full, free_swa = list(range(num_full)), list(range(num_swa))
    rng.shuffle(free_full)
    rng.shuffle(free_swa)
    seqs = []
    for i in range(num_seqs):
        decode = rng.random() < 0.5
        start = rng.randint(1, 120) if decode else rng.choice([0, rng.randint(1, 90)])
        n = 1 if decode else rng.randint(2, 70)
        end = start + n
        full = [free_full.pop() for _ in range(end)]
        s0 = max(0, start - window + 1)
        swa = [free_swa.pop() for _ in range(end - s0)]
        sp = []
        if spans and n >= 6 and rng.random() < 0.9:  # an image inside the chunk, as the scheduler keeps it
            a = rng.randint(start, end - 4)
            sp = [(a, min(end, a + rng.randint(3, 24)))]
        seqs.append(SeqForward(f"r{i}", [7] * n, start, full[start:], swa[-n:], s0, True,
                               reset_full=full[:start], reset_swa=swa[:-n], bidirectional_spans=sp))
    rng.shuffle(seqs)
    return ForwardBatch(seqs)


def prepare(backend, batch, window):
    """Slot tables filled from the batch's resets (every seq carries one), then the metadata."""
    return backend.prepare(batch, DeviceSlotTables().apply(batch), window, torch.device("cpu"))


def run_backend(backend, batch, window, kind, q, k, v, cache, params):
    meta = prepare(backend, batch, window)
    c = LayerKV(cache.k.clone(), cache.v.clone())
    return backend.forward(kind, q, k, v, c, meta, params), c


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("kind", [FULL, SLIDING])
def test_batched_matches_loop_on_random_steps(seed, kind):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    window = rng.choice([4, 16, 33])
    hkv = rng.choice([1, 2, 4])  # GQA groups 4, 2, 1
    batch = random_step(rng, window, num_seqs=rng.randint(2, 9), num_full=2048, num_swa=2048, spans=seed % 3 != 1)
    t = batch.num_tokens
    q, k = torch.randn(t, HQ, D, generator=g), torch.randn(t, hkv, D, generator=g)
    v = torch.randn(t, hkv, DV, generator=g)
    cache = LayerKV(torch.randn(hkv, 2048, D, generator=g), torch.randn(hkv, 2048, DV, generator=g))
    params = AttentionParams(
        scale=D ** -0.5,
        sinks=torch.randn(HQ, generator=g) * 3 if seed % 3 != 1 else None,
        softcap=5.0 if seed % 3 == 2 else None,
    )
    ref, ref_cache = run_backend(create_attention_backend("torch_sdpa_loop"), batch, window, kind, q, k, v, cache,
                                 params)
    # small buckets and tiny score caps so padding, query blocks and query slicing all happen
    for policy in (BucketPolicy(), BucketPolicy(max_pad_ratio=4.0, q_block=8, max_score_elems=2000),
                   BucketPolicy(max_pad_ratio=1.0, pad_slack=0, q_block=0)):
        backend = TorchBatchedAttention(policy)
        got, got_cache = run_backend(backend, batch, window, kind, q, k, v, cache, params)
        for bucket in prepare(backend, batch, window).kinds[kind].buckets:
            assert (bucket.bias > float("-inf")).any(-1).all()  # every row, padded or not, has a key
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(got_cache.k, ref_cache.k) and torch.equal(got_cache.v, ref_cache.v)


def test_spans_change_the_output():
    """The span-bearing random steps above really exercise bidirectional masks."""
    rng = random.Random(0)
    batch = random_step(rng, 16, 8, 2048, 2048, spans=True)
    assert any(s.bidirectional_spans for s in batch.seqs)
    g = torch.Generator().manual_seed(0)
    t = batch.num_tokens
    q, k, v = torch.randn(t, HQ, D, generator=g), torch.randn(t, 2, D, generator=g), torch.randn(t, 2, DV, generator=g)
    cache = LayerKV(torch.randn(2, 2048, D, generator=g), torch.randn(2, 2048, DV, generator=g))
    params = AttentionParams(scale=0.3)
    with_spans, _ = run_backend(TorchBatchedAttention(), batch, 16, FULL, q, k, v, cache, params)
    for s in batch.seqs:
        s.bidirectional_spans = []
    causal, _ = run_backend(TorchBatchedAttention(), batch, 16, FULL, q, k, v, cache, params)
    assert not torch.allclose(with_spans, causal, atol=1e-3)


@pytest.mark.parametrize("seed", range(20))
def test_plan_buckets_bounds_padding(seed):
    rng = random.Random(seed)
    sizes = [(1, rng.randint(1, 300)) if rng.random() < 0.6 else (rng.randint(2, 64), rng.randint(64, 400))
             for _ in range(rng.randint(1, 40))]
    policy = BucketPolicy(max_pad_ratio=1.3, pad_slack=100, max_pairs=20000)
    plan = plan_buckets(sizes, policy)
    assert sorted(i for b in plan for i in b) == list(range(len(sizes)))
    for b in plan:
        n = {sizes[i][0] for i in b}
        if n == {1}:  # the decodes: one bucket, padded in keys only
            assert b == [i for i, (q, _) in enumerate(sizes) if q == 1]
        elif len(b) > 1:
            padded = len(b) * max(n) * max(sizes[i][1] for i in b)
            real = sum(sizes[i][0] * sizes[i][1] for i in b)
            assert padded <= 1.3 * real + 100 * (len(b) - 1) and padded <= 20000


def test_one_long_prefill_and_many_decodes_stay_apart():
    """Memory: decodes must not be padded up to a long chunk's query count."""
    sizes = [(2048, 4096)] + [(1, 4000 + i) for i in range(64)]
    plan = plan_buckets(sizes, BucketPolicy(q_block=0))
    assert [0] in plan and sum(len(b) for b in plan if 0 not in b) == 64
    long = SeqForward("long", [1] * 300, 0, list(range(300)), list(range(300)), 0, True)
    decodes = [SeqForward(f"d{i}", [1], 200, [300 + i], [300 + i], 185, True, reset_full=list(range(200)),
                          reset_swa=list(range(185, 200))) for i in range(32)]
    batch = ForwardBatch([long, *decodes])
    meta = prepare(TorchBatchedAttention(BucketPolicy(q_block=64)), batch, 16)
    for kind in (FULL, SLIDING):
        biggest = max(b.bias.numel() for b in meta.kinds[kind].buckets)
        assert biggest <= 2 * 300 * 300  # not (1 + 32) * 300 * 300


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kind", [FULL, SLIDING])
@pytest.mark.parametrize("backend", ["sdpa", "cpu_flash", "cpu_flash+pools"])
def test_sdpa_backends_match_batched_on_cpu(seed, kind, backend):
    """``sdpa`` (the CUDA default) and ``cpu_flash`` (the CPU default) equal ``torch_batched``:
    window, GQA, padding, bidirectional spans, and sinks (an extra zero key in ``sdpa``, the
    kernel's log-sum-exp in ``cpu_flash``). ``+pools``: told its pools are float32, as the runner
    tells it, ``cpu_flash`` sends prefill buckets to the paged prefill kernel."""
    rng = random.Random(100 + seed)
    g = torch.Generator().manual_seed(seed)
    window = rng.choice([4, 16, 33])
    hkv = rng.choice([1, 2, 4])
    batch = random_step(rng, window, num_seqs=rng.randint(2, 9), num_full=2048, num_swa=2048, spans=seed % 2 == 0)
    t = batch.num_tokens
    q, k = torch.randn(t, HQ, D, generator=g), torch.randn(t, hkv, D, generator=g)
    v = torch.randn(t, hkv, DV, generator=g)
    cache = LayerKV(torch.randn(hkv, 2048, D, generator=g), torch.randn(hkv, 2048, DV, generator=g))
    params = AttentionParams(scale=D ** -0.5, sinks=torch.randn(HQ, generator=g) * 3 if seed % 3 else None)
    ref, ref_cache = run_backend(TorchBatchedAttention(), batch, window, kind, q, k, v, cache, params)
    be = create_attention_backend(backend.split("+")[0])
    if backend.endswith("+pools"):
        be.bind_pools(torch.float32)
        assert be.prefill_kernel and not be.policy.sliding_per_query
        buckets = prepare(be, batch, window).kinds[kind].buckets
        chunks = [s for s in batch.seqs if len(s.token_ids) > 1]
        if chunks and not any(s.bidirectional_spans for s in chunks):  # then every chunk is the kernel's
            assert all(b.tail for b in buckets if b.nq > 1) and any(b.nq > 1 for b in buckets)
    got, got_cache = run_backend(be, batch, window, kind, q, k, v, cache, params)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_cache.k, ref_cache.k)


def test_prefill_kernel_is_what_runs(monkeypatch):
    """With float32, bfloat16 or float16 pools a step's prefill chunks (full and sliding) reach
    ``cpu_prefill`` and equal the gather path's answer; a soft-capped layer keeps them off it."""
    from llm_svc.attention import cpu_prefill

    calls = []
    real = cpu_prefill.paged_prefill
    monkeypatch.setattr(cpu_prefill, "paged_prefill", lambda *a, **kw: calls.append(a[-2]) or real(*a, **kw))
    rng = random.Random(3)
    batch = random_step(rng, 16, 6, 2048, 2048, spans=False)
    t = batch.num_tokens
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(t, HQ, D, generator=g), torch.randn(t, 2, D, generator=g), torch.randn(t, 2, DV, generator=g)
    for dtype, softcap in ((torch.float32, None), (torch.bfloat16, None), (torch.float16, None),
                           (torch.float32, 5.0)):
        be = create_attention_backend("cpu_flash")
        be.bind_pools(dtype)
        assert be.prefill_kernel
        cache = LayerKV(torch.randn(2, 2048, D, generator=g).to(dtype), torch.randn(2, 2048, DV, generator=g).to(dtype))
        calls.clear()
        params = AttentionParams(scale=0.3, softcap=softcap)
        for kind in (FULL, SLIDING):
            got, _ = run_backend(be, batch, 16, kind, q, k, v, cache, params)
            ref, _ = run_backend(TorchBatchedAttention(), batch, 16, kind, q, k, v, cache, params)
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        assert (sorted(set(calls), key=str) == [16, None]) if softcap is None else not calls


def test_auto_backend_per_device():
    assert create_attention_backend("auto", "cpu").name == "cpu_flash"
    assert create_attention_backend("auto", "cuda").name == "sdpa"  # built lazily: no GPU needed here


@pytest.mark.parametrize("dims", [(16, 16), (16, 12), (12, 16)])
@pytest.mark.parametrize("sinks", [False, True])
def test_cpu_flash_full_chunks_attend_causally_without_a_mask(dims, sinks):
    """Long full-layer chunks after a context (the kernel's 256-query / 512-key blocks, a partial
    last block) and one from position 0, padded together in one bucket: ``cpu_flash`` takes its
    mask-free causal path (no bias is ever built) and equals ``torch_batched``."""
    d, dv = dims
    hkv, window = 2, 64
    g = torch.Generator().manual_seed(7)
    slots = torch.randperm(4096, generator=g).tolist()
    seqs = []
    for i, (start, n) in enumerate([(700, 900), (0, 333)]):
        full, slots = slots[:start + n], slots[start + n:]
        s0 = max(0, start - window + 1)
        swa, slots = slots[:start + n - s0], slots[start + n - s0:]
        seqs.append(SeqForward(f"r{i}", [7] * n, start, full[start:], swa[-n:], s0, True,
                               reset_full=full[:start], reset_swa=swa[:-n]))
    batch = ForwardBatch(seqs)
    t = batch.num_tokens
    q, k = torch.randn(t, HQ, d, generator=g), torch.randn(t, hkv, d, generator=g)
    v = torch.randn(t, hkv, dv, generator=g)
    cache = LayerKV(torch.randn(hkv, 4096, d, generator=g), torch.randn(hkv, 4096, dv, generator=g))
    params = AttentionParams(scale=d ** -0.5, sinks=torch.randn(HQ, generator=g) * 3 if sinks else None)
    ref, _ = run_backend(TorchBatchedAttention(), batch, window, FULL, q, k, v, cache, params)
    backend = create_attention_backend("cpu_flash")
    meta = prepare(backend, batch, window)
    got = backend.forward(FULL, q, k, v, LayerKV(cache.k.clone(), cache.v.clone()), meta, params)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    buckets = meta.kinds[FULL].buckets
    assert buckets and all(bk.tail and bk.window is None and bk._bias is None for bk in buckets)
    assert sum(len(bk.ns) for bk in buckets) == 2


def test_cpu_flash_sends_sliding_prefill_queries_to_the_single_query_kernel():
    """Sliding layers on ``cpu_flash``: every query of a chunk without spans (and every decode) is
    one member of a single ``nq = 1`` bucket over exactly its window, read in place by the paged
    kernel; a chunk with a bidirectional span keeps query blocks; full layers keep whole chunks.
    The output equals ``torch_batched``'s."""
    from llm_svc.attention import cpu_paged

    assert cpu_paged.available()  # CI builds the kernel: the path under test is the default
    window, hkv = 16, 2
    free = list(range(512))
    seqs = []
    for i, (start, n, span) in enumerate([(0, 40, None), (30, 1, None), (5, 20, (10, 14)), (50, 33, None)]):
        slots = [free.pop() for _ in range(start + n)]
        s0 = max(0, start - window + 1)
        seqs.append(SeqForward(f"r{i}", [7] * n, start, slots[start:], slots[s0:][-n:], s0, True,
                               reset_full=slots[:start], reset_swa=slots[s0:][:-n],
                               bidirectional_spans=[span] if span else []))
    batch = ForwardBatch(seqs)
    backend = create_attention_backend("cpu_flash")
    meta = prepare(backend, batch, window)
    single = meta.kinds[SLIDING].buckets[0]
    assert single.nq == 1 and single.lens.shape[0] == 40 + 1 + 33
    pos = torch.cat([torch.arange(0, 40), torch.tensor([30]), torch.arange(50, 83)])
    assert torch.equal(single.lens, torch.clamp(pos + 1, max=window))  # its window: (p - W, p]
    assert [bk.nq for bk in meta.kinds[SLIDING].buckets[1:]] and all(bk.nq > 1 for bk in meta.kinds[SLIDING].buckets[1:])
    assert all(bk.nq > 1 or bk.lens.shape[0] == 1 for bk in meta.kinds[FULL].buckets)  # chunks whole, one decode
    g = torch.Generator().manual_seed(5)
    t = batch.num_tokens
    q, k, v = torch.randn(t, HQ, D, generator=g), torch.randn(t, hkv, D, generator=g), torch.randn(t, hkv, DV, generator=g)
    cache = LayerKV(torch.randn(hkv, 512, D, generator=g), torch.randn(hkv, 512, DV, generator=g))
    params = AttentionParams(scale=D ** -0.5, sinks=torch.randn(HQ, generator=g))
    for kind in (SLIDING, FULL):
        ref, _ = run_backend(TorchBatchedAttention(), batch, window, kind, q, k, v, cache, params)
        got, _ = run_backend(backend, batch, window, kind, q, k, v, cache, params)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_cpu_flash_keeps_query_blocks_for_windows_past_the_per_query_bound():
    free = list(range(4096))
    slots = [free.pop() for _ in range(700)]
    batch = ForwardBatch([SeqForward("r", [7] * 700, 0, slots, slots, 0, True)])
    backend = create_attention_backend("cpu_flash")
    wide = backend.policy.per_query_max_window + 1
    assert all(bk.nq > 1 for bk in prepare(backend, batch, wide).kinds[SLIDING].buckets)
    assert [bk.nq for bk in prepare(backend, batch, 128).kinds[SLIDING].buckets] == [1]


def test_cpu_flash_single_queries_on_a_pool_the_kernel_cannot_read_are_gathered_in_slices(monkeypatch):
    """A pool the paged kernel cannot read (here: bfloat16 with its build taken away): a long
    sliding chunk's single queries are attended a slice at a time (no gather of every query's
    window at once) and equal ``torch_batched``."""
    from llm_svc.attention import cpu_flash, cpu_paged

    monkeypatch.setattr(cpu_flash, "GATHER_SLICE", 64)
    monkeypatch.delitem(cpu_paged.KERNELS, torch.bfloat16)
    window, hkv, n = 16, 2, 300
    slots = list(range(1000, 1000 + n))
    batch = ForwardBatch([SeqForward("r", [7] * n, 0, slots, slots, 0, True)])
    g = torch.Generator().manual_seed(9)
    q, k, v = torch.randn(n, HQ, D, generator=g), torch.randn(n, hkv, D, generator=g), torch.randn(n, hkv, DV, generator=g)
    cache = LayerKV(torch.zeros(hkv, 2048, D, dtype=torch.bfloat16), torch.zeros(hkv, 2048, DV, dtype=torch.bfloat16))
    params = AttentionParams(scale=D ** -0.5, sinks=torch.randn(HQ, generator=g))
    backend = create_attention_backend("cpu_flash")
    calls = []
    real = TorchBatchedAttention.attend_bucket
    monkeypatch.setattr(TorchBatchedAttention, "attend_bucket",
                        lambda self, bk, qq, c, p: calls.append(qq.shape[0]) or real(self, bk, qq, c, p))
    got, _ = run_backend(backend, batch, window, SLIDING, q, k, v, cache, params)
    assert calls == [64, 64, 64, 64, 44]
    ref, _ = run_backend(TorchBatchedAttention(), batch, window, SLIDING, q, k, v, cache, params)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
