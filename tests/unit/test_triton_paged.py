"""The ``triton_paged`` backend on CPU: its Triton kernel run by the Triton interpreter
(``TRITON_INTERPRET=1``, read when the kernel is first built for a mode), its plain-torch
reference and its per-row key ranges, all against ``torch_batched`` on small random steps:
full and sliding layers, sinks, soft-cap, qk dim != v dim, GQA, Gemma 3 bidirectional spans,
scattered slots, prefill chunks after a cached prefix mixed with decodes; and the registered
backend end to end over several steps of persistent slot tables."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from llm_svc.attention import FULL, SLIDING, AttentionParams, LayerKV, create_attention_backend
from llm_svc.attention.paged_ref import paged_attention_ref
from llm_svc.attention.paged_rows import row_ranges
from llm_svc.attention.slot_tables import DeviceSlotTables
from llm_svc.attention.triton_paged import TritonPagedAttention, paged_attention_triton
from llm_svc.types.request import ForwardBatch, SeqForward

pytestmark = pytest.mark.unit
POOL = 512
CPU = torch.device("cpu")


@pytest.fixture
def interpret(monkeypatch):
    """Triton kernels on CPU tensors: the interpreter (numpy)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


class Slots:
    """Disjoint pool slots handed out in a random order (pages scattered over the pool)."""

    def __init__(self, rng: random.Random, n: int = POOL):
        self.full, self.swa = list(range(n)), list(range(n))
        rng.shuffle(self.full)
        rng.shuffle(self.swa)

    def take(self, k: int) -> tuple[list[int], list[int]]:
        return [self.full.pop() for _ in range(k)], [self.swa.pop() for _ in range(k)]


def new_seq(rid: str, slots: Slots, start: int, n: int, window: int, spans=()) -> SeqForward:
    """A chunk at ``start..start+n-1``; ``start > 0``: a cached prefix, given as a reset."""
    full, swa = slots.take(start + n)
    s0 = max(0, start - window + 1)
    return SeqForward(rid, [5] * n, start, full[start:], swa[start:], s0, True,
                      reset_full=full[:start], reset_swa=swa[s0:start], bidirectional_spans=list(spans))


def mixed_step(rng: random.Random, window: int, spans: bool = True) -> ForwardBatch:
    """Prefill chunks from 0 and after a cached prefix (some with an image span), decodes."""
    slots = Slots(rng)
    seqs = [new_seq("p0", slots, 0, rng.randint(20, 40), window),
            new_seq("p1", slots, rng.randint(5, 30), rng.randint(10, 36), window),
            new_seq("d0", slots, rng.randint(30, 60), 1, window),
            new_seq("d1", slots, rng.randint(1, 9), 1, window),
            new_seq("d2", slots, rng.randint(30, 60), 1, window)]
    if spans:
        s = seqs[1]
        a = rng.randint(s.start, s.end - 6)
        s.bidirectional_spans = [(a, a + rng.randint(4, 12))]  # may run past the chunk's end
        seqs[0].bidirectional_spans = [(3, 9), (12, 19)]
    rng.shuffle(seqs)
    return ForwardBatch(seqs)


def qkv(g: torch.Generator, t: int, hq: int, hkv: int, d: int, dv: int):
    return torch.randn(t, hq, d, generator=g), torch.randn(t, hkv, d, generator=g), torch.randn(t, hkv, dv, generator=g)


def make_inputs(seed: int, t: int, hq: int, hkv: int, d: int, dv: int, sinks: bool, softcap: float | None,
                pool_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v = qkv(g, t, hq, hkv, d, dv)
    cache = LayerKV(torch.randn(hkv, POOL, d, generator=g).to(pool_dtype),
                    torch.randn(hkv, POOL, dv, generator=g).to(pool_dtype))
    params = AttentionParams(scale=d ** -0.5, sinks=torch.randn(hq, generator=g) * 2 if sinks else None,
                             softcap=softcap)
    return q, k, v, cache, params


def batched(batch, window, kind, q, k, v, cache, params):
    """``torch_batched`` (the reference) on a copy of ``cache``: output and the written cache."""
    be = create_attention_backend("torch_batched")
    c = LayerKV(cache.k.clone(), cache.v.clone())
    meta = be.prepare(batch, DeviceSlotTables().apply(batch), window, CPU)
    return be.forward(kind, q, k, v, c, meta, params), c


# name: (kind, window, hq, hkv, d, dv, sinks, softcap, spans, tile_m)
CASES = {
    "full_gqa_spans": (FULL, 8, 4, 2, 32, 16, False, None, True, 16),
    "sliding_sinks": (SLIDING, 8, 4, 2, 32, 16, True, None, False, 64),
    "sliding_spans_sinks": (SLIDING, 16, 4, 2, 16, 16, True, None, True, 16),
    "sliding_softcap_mha": (SLIDING, 6, 2, 2, 16, 16, False, 5.0, True, 64),
    "full_sinks_softcap_g4_mimo_tiny": (FULL, 8, 4, 1, 24, 16, True, 5.0, True, 64),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_and_ref_match_batched(name, interpret):
    kind, window, hq, hkv, d, dv, sinks, softcap, spans, tile_m = CASES[name]
    rng = random.Random(name)
    batch = mixed_step(rng, window, spans)
    t = batch.num_tokens
    q, k, v, cache, params = make_inputs(len(name), t, hq, hkv, d, dv, sinks, softcap)
    want, written = batched(batch, window, kind, q, k, v, cache, params)
    rr = row_ranges(batch, DeviceSlotTables().apply(batch), window, CPU)[kind]
    ref = paged_attention_ref(q, written.k, written.v, rr, params.scale, params.sinks, params.softcap)
    torch.testing.assert_close(ref, want, atol=1e-5, rtol=1e-5)
    got = paged_attention_triton(q, written.k, written.v, rr, params.scale, params.sinks, params.softcap,
                                 block_n=16, tile_m=tile_m)
    assert got.shape == (t, hq, dv) and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # the comparison can fail: a different window / no sinks / no spans changes the result
    if kind == SLIDING:
        rr_wrong = row_ranges(batch, DeviceSlotTables().apply(batch), window + 3, CPU)[kind]
        wrong = paged_attention_ref(q, written.k, written.v, rr_wrong, params.scale, params.sinks, params.softcap)
        assert not torch.allclose(wrong, want, atol=1e-3)
    if sinks:
        wrong = paged_attention_ref(q, written.k, written.v, rr, params.scale, None, params.softcap)
        assert not torch.allclose(wrong, want, atol=1e-3)


@pytest.mark.parametrize("d,dv", [(192, 128), (96, 96), (64, 64)])
def test_kernel_real_head_dims(d, dv, interpret):
    """MiMo's qk 192 / v 128 and other real head sizes: padded power-of-two tiles, masked."""
    rng = random.Random(d)
    slots = Slots(rng)
    batch = ForwardBatch([new_seq("a", slots, 3, 14, 8, [(5, 9)]), new_seq("b", slots, 20, 1, 8)])
    q, k, v, cache, params = make_inputs(d, batch.num_tokens, 4, 2, d, dv, True, None)
    for kind in (FULL, SLIDING):
        want, written = batched(batch, 8, kind, q, k, v, cache, params)
        rr = row_ranges(batch, DeviceSlotTables().apply(batch), 8, CPU)[kind]
        got = paged_attention_triton(q, written.k, written.v, rr, params.scale, params.sinks, None)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_kernel_bf16_pool_fp32_compute(interpret):
    """A KV pool in bfloat16 under a float32 model: K/V are upcast on read, as the reference does."""
    rng = random.Random(7)
    batch = mixed_step(rng, 8, spans=False)
    q, k, v, cache, params = make_inputs(7, batch.num_tokens, 4, 2, 16, 16, True, None, pool_dtype=torch.bfloat16)
    for kind in (FULL, SLIDING):
        want, written = batched(batch, 8, kind, q, k, v, cache, params)
        assert written.k.dtype == torch.bfloat16
        rr = row_ranges(batch, DeviceSlotTables().apply(batch), 8, CPU)[kind]
        got = paged_attention_triton(q, written.k, written.v, rr, params.scale, params.sinks, None, block_n=16)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_row_ranges_by_hand():
    """lo / hi per row: causal, window from ``max(swa_ctx_start, q - W + 1)``, spans widen hi
    up to ``min(e, end) - 1``; rows in batch order; slot-table rows of each sequence."""
    slots = Slots(random.Random(0))
    window = 4
    a = new_seq("a", slots, 6, 5, window, [(7, 9), (10, 14)])  # positions 6..10; second span past the end
    b = new_seq("b", slots, 9, 1, window)  # a decode at 9
    batch = ForwardBatch([a, b])
    tables = DeviceSlotTables().apply(batch)
    rr = row_ranges(batch, tables, window, CPU)
    assert rr[FULL].hi.tolist() == [6, 8, 8, 9, 10, 9]
    assert rr[FULL].lo.tolist() == [0] * 6
    assert rr[SLIDING].lo.tolist() == [3, 4, 5, 6, 7, 6]
    assert rr[SLIDING].hi.tolist() == rr[FULL].hi.tolist()
    assert rr[FULL].trow.tolist() == [tables.rows[0]] * 5 + [tables.rows[1]]
    assert rr[FULL].out_slots.tolist() == a.out_full_slots + b.out_full_slots
    assert rr[SLIDING].out_slots.tolist() == a.out_swa_slots + b.out_swa_slots
    assert rr[FULL].max_len == 11 and rr[SLIDING].max_len == 5  # row of position 8: keys 5..8 + span to 8
    assert rr[FULL].table is tables.full and rr[SLIDING].table is tables.swa
    r0, n = rr[FULL].blocks(2, multi=True)
    assert r0.tolist() == [0, 2, 4] and n.tolist() == [2, 2, 1]
    r0, n = rr[FULL].blocks(2, multi=False)
    assert r0.tolist() == [5] and n.tolist() == [1]


def _step_seq(slots: Slots, rid: str, start: int, n: int, window: int, spans=()) -> SeqForward:
    """A continuation (no reset): the runner's table already covers ``0..start-1``."""
    full, swa = slots.take(n)
    return SeqForward(rid, [5] * n, start, full, swa, max(0, start - window + 1), True,
                      bidirectional_spans=list(spans))


@pytest.mark.parametrize("kind", [FULL, SLIDING])
def test_backend_end_to_end_over_steps(kind, interpret):
    """prepare + forward of the registered backend through persistent ``DeviceSlotTables``
    over three steps (prefill chunks, a continuation, a cached-prefix arrival, decodes, a
    dropped request) equals ``torch_batched``, outputs and written pools."""
    window, hq, hkv, d, dv = 6, 4, 2, 16, 8
    rng = random.Random(kind)
    slots = Slots(rng)
    steps = [
        ForwardBatch([new_seq("a", slots, 0, 20, window, [(4, 10)]), new_seq("b", slots, 0, 9, window)]),
        ForwardBatch([_step_seq(slots, "a", 20, 12, window, [(25, 29)]), _step_seq(slots, "b", 9, 1, window),
                      new_seq("c", slots, 14, 7, window)]),
        ForwardBatch([_step_seq(slots, "c", 21, 1, window), _step_seq(slots, "a", 32, 1, window)], dropped=["b"]),
    ]
    backends = [create_attention_backend("triton_paged"), create_attention_backend("torch_batched")]
    assert isinstance(backends[0], TritonPagedAttention) and backends[0].name == "triton_paged"
    tables = [DeviceSlotTables(rows=2, capacity=16), DeviceSlotTables(rows=2, capacity=16)]  # both grow
    _, _, _, cache, params = make_inputs(1, 1, hq, hkv, d, dv, kind == SLIDING, None)
    caches = [LayerKV(cache.k.clone(), cache.v.clone()), LayerKV(cache.k.clone(), cache.v.clone())]
    g = torch.Generator().manual_seed(3)
    for batch in steps:
        t = batch.num_tokens
        q, k, v = qkv(g, t, hq, hkv, d, dv)
        outs = []
        for be, tab, c in zip(backends, tables, caches):
            meta = be.prepare(batch, tab.apply(batch), window, CPU)
            outs.append(be.forward(kind, q, k, v, c, meta, params))
        torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
        assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)


def test_backend_without_interpreter_uses_the_reference(monkeypatch):
    """On a CPU without ``TRITON_INTERPRET`` the backend still works (plain-torch reference)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rng = random.Random(11)
    batch = mixed_step(rng, 8)
    q, k, v, cache, params = make_inputs(11, batch.num_tokens, 4, 2, 16, 8, True, 3.0)
    be = create_attention_backend("triton_paged")
    for kind in (FULL, SLIDING):
        want, written = batched(batch, 8, kind, q, k, v, cache, params)
        c = LayerKV(cache.k.clone(), cache.v.clone())
        got = be.forward(kind, q, k, v, c, be.prepare(batch, DeviceSlotTables().apply(batch), 8, CPU), params)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(c.k, written.k) and torch.equal(c.v, written.v)


def test_registering_the_backend_does_not_import_triton():
    code = ("import sys; from llm_svc.attention import create_attention_backend as c; "
            "c('triton_paged'); c('torch_batched'); assert 'triton' not in sys.modules, 'triton imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
