"""The packed routed-experts kernel (``cpu_packed``) equals a float64 reference, does not depend on
its thread count, and is what ``RoutedExperts`` runs for SiLU-gated experts whose shape packs."""

import pytest
import torch
import torch.nn.functional as F

from llm_svc.models import cpu_gemv, cpu_packed
from llm_svc.models.fused_mlp import RoutedExperts
from tests.moe_ref import moe_reference

pytestmark = pytest.mark.unit


def _weights(e, h, i, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(e, 2 * i, h, generator=g) / h ** 0.5, torch.randn(e, h, i, generator=g) / i ** 0.5


def _route(t, e, k, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.empty(0, k, dtype=torch.int64)
    return idx, torch.rand(t, k, generator=g)


def test_kernel_builds_here():
    assert cpu_packed.KERNEL.available()  # CI has a compiler: a failed build must fail here, not fall back


@pytest.mark.parametrize("tokens", [1, 3, 9, 37, 300])
def test_packed_experts_equal_the_float64_reference_on_any_thread_count(tokens):
    e, h, i, k = 6, 64, 32, 2
    gate_up, down = _weights(e, h, i, seed=tokens)
    packed = cpu_packed.pack(gate_up, down)
    x = torch.randn(tokens, h, generator=torch.Generator().manual_seed(tokens + 1))
    idx, w = _route(tokens, e, k, seed=tokens + 2)
    want = moe_reference(x, idx, w, gate_up, down)
    one = cpu_packed.moe(x, idx, w, packed, threads=1)
    torch.testing.assert_close(one.double(), want, atol=1e-5, rtol=1e-5)
    for threads in (2, 4):  # the pool's work items write disjoint columns in a fixed order
        assert torch.equal(cpu_packed.moe(x, idx, w, packed, threads=threads), one)
    # the routing matters: another choice of experts (or weights) gives another result
    assert not torch.allclose(cpu_packed.moe(x, (idx + 1) % e, w, packed, threads=1), one)
    assert not torch.allclose(cpu_packed.moe(x, idx, w.flip(1) + 0.5, packed, threads=1), one)


def test_a_token_routed_twice_to_one_expert_counts_twice_and_no_tokens_is_empty():
    gate_up, down = _weights(4, 32, 16)
    packed = cpu_packed.pack(gate_up, down)
    x = torch.randn(5, 32)
    idx = torch.tensor([[1, 1], [0, 3], [2, 2], [3, 0], [1, 2]])
    w = torch.rand(5, 2)
    torch.testing.assert_close(cpu_packed.moe(x, idx, w, packed).double(), moe_reference(x, idx, w, gate_up, down),
                               atol=1e-5, rtol=1e-5)
    assert cpu_packed.moe(torch.empty(0, 32), torch.empty(0, 2, dtype=torch.int64), torch.empty(0, 2), packed).shape == (0, 32)


@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_sized_calls_equal_decode_sized_ones_bit_for_bit(threads):
    """A call with many (token, expert) pairs takes the row-group passes (an item: up to 96 pairs
    of one expert; per-pair products summed per token in expert order), a few-pair call the
    column-block passes: each token's row must come out the same either way, a token routed
    twice to one expert and an expert with no token included."""
    e, h, i, k = 6, 64, 32, 3
    gate_up, down = _weights(e, h, i, seed=7)
    packed = cpu_packed.pack(gate_up, down)
    g = torch.Generator().manual_seed(8)
    t = 500
    x = torch.randn(t, h, generator=g)
    idx = torch.randint(0, e - 1, (t, k), generator=g)  # expert e - 1 idle; repeats within a token
    idx[:4] = torch.tensor([[2, 2, 0], [1, 3, 1], [4, 0, 2], [3, 3, 3]])
    w = torch.rand(t, k, generator=g)
    big = cpu_packed.moe(x, idx, w, packed, threads=threads)
    torch.testing.assert_close(big[:40].double(), moe_reference(x[:40], idx[:40], w[:40], gate_up, down),
                               atol=1e-5, rtol=1e-5)
    for a in range(0, 40, 5):  # 5 tokens: 15 pairs, the column-block passes
        assert torch.equal(cpu_packed.moe(x[a:a + 5], idx[a:a + 5], w[a:a + 5], packed, threads=threads), big[a:a + 5])


def test_an_expert_index_out_of_range_is_refused():
    packed = cpu_packed.pack(*_weights(4, 32, 16))
    with pytest.raises(ValueError, match="expert index"):
        cpu_packed.moe(torch.randn(2, 32), torch.tensor([[0, 4], [1, 2]]), torch.rand(2, 2), packed)
    with pytest.raises(ValueError, match="expert index"):
        cpu_packed.moe(torch.randn(2, 32), torch.tensor([[0, -1], [1, 2]]), torch.rand(2, 2), packed)


def test_shapes_the_kernel_cannot_tile_are_not_packable():
    assert cpu_packed.packable(*_weights(4, 64, 32))
    assert not cpu_packed.packable(*_weights(4, 64, 12))  # I not a multiple of the vector width
    assert not cpu_packed.packable(*_weights(4, 40, 32))  # H not a multiple of twice it
    gu, dn = _weights(4, 64, 32)
    assert not cpu_packed.packable(gu.double(), dn.double())


@pytest.mark.parametrize("i", [32, 12])
def test_routed_experts_run_packed_where_the_shape_packs_and_fall_back_elsewhere(i):
    gate_up, down = _weights(5, 64, i, seed=i)
    experts = RoutedExperts(gate_up, down, F.silu)
    assert (experts._packed is not None) == (i == 32)
    for tokens in (2, 200):  # a decode step's tokens and a prefill chunk's
        x = torch.randn(tokens, 64)
        idx, w = _route(tokens, 5, 2, seed=tokens)
        torch.testing.assert_close(experts(x, idx, w).double(), moe_reference(x, idx, w, gate_up, down),
                                   atol=1e-5, rtol=1e-5)
    # packed: the per-expert GEMMs (oneDNN's reordered copies) are never made
    assert (experts._linears is None) == (i == 32)


def test_a_decode_step_runs_on_the_few_row_kernels_threads_and_a_prefill_on_torchs(monkeypatch):
    torch_before = torch.get_num_threads()
    try:
        monkeypatch.setattr(cpu_gemv, "_threads", 3)
        torch.set_num_threads(1)  # a decode step: torch on one thread, the pool on three
        assert cpu_gemv.pool_threads() == 3 and cpu_gemv.pool() == (cpu_gemv.par_for_address(), 3)
        monkeypatch.setattr(cpu_gemv, "_threads", 1)
        torch.set_num_threads(2)  # a prefill while the machine is busy: torch's count, the pool elastic
        assert cpu_gemv.pool_threads() == 2 and cpu_gemv.pool() == (cpu_gemv.par_for_address(), 2)
        assert cpu_gemv.pool(1) == (None, 1)  # one thread: the call runs inline
    finally:
        torch.set_num_threads(torch_before)


@pytest.mark.parametrize("rows", [0, 1, 5, 8, 97, 300])
@pytest.mark.parametrize("n", [48, 70])  # a whole number of column blocks, and a ragged last one
def test_packed_linear_equals_f_linear_on_any_thread_count(rows, n):
    g = torch.Generator().manual_seed(rows * 100 + n)
    w, b = torch.randn(n, 40, generator=g) / 6, torch.randn(n, generator=g)
    x = torch.randn(rows, 40, generator=g)
    packed = cpu_packed.pack_linear(w)
    want = F.linear(x.double(), w.double(), b.double())
    one = cpu_packed.linear(x, packed, n, b, threads=1)
    assert one.shape == (rows, n)
    torch.testing.assert_close(one.double(), want, atol=1e-5, rtol=1e-5)
    for threads in (2, 4):
        assert torch.equal(cpu_packed.linear(x, packed, n, b, threads=threads), one)
    torch.testing.assert_close(cpu_packed.linear(x, packed, n).double(), want - b.double(), atol=1e-5, rtol=1e-5)


def test_packed_linear_takes_batched_and_strided_inputs():
    w = torch.randn(33, 16)
    packed = cpu_packed.pack_linear(w)
    x = torch.randn(2, 3, 32)[..., ::2]  # [2, 3, 16], stride 2 inside a row
    torch.testing.assert_close(cpu_packed.linear(x, packed, 33), F.linear(x, w), atol=1e-5, rtol=1e-5)
    rows = torch.randn(5, 24)[:, 4:20]  # row stride 24
    torch.testing.assert_close(cpu_packed.linear(rows, packed, 33), F.linear(rows, w), atol=1e-5, rtol=1e-5)
