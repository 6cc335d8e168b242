"""Linear backends: our packed kernel and oneDNN equal ``F.linear`` (float32 rounding), for plain
linears, the fused gated MLP and the routed experts; ``auto`` picks our kernel for float32 on
CPU here, oneDNN for bfloat16, torch where neither can run; ``torch`` leaves modules alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llm_svc.models import linear as L
from llm_svc.models.fused_mlp import GatedMLP, RoutedExperts

pytestmark = pytest.mark.unit


def test_onednn_available_on_this_cpu():
    """CI's torch (the CUDA build, run on the CPU) has oneDNN: the fast path is what is tested."""
    assert L.onednn_available()
    assert L.resolve("auto", torch.zeros(2, 2)) == "packed"  # CI has a compiler: our kernel builds
    assert L.resolve("onednn", torch.zeros(2, 2)) == "onednn"
    bf16 = torch.zeros(2, 2, dtype=torch.bfloat16)  # our kernel's bfloat16 build
    assert L.resolve("auto", bf16) == L.resolve("packed", bf16) == "packed"
    f16 = torch.zeros(2, 2, dtype=torch.float16)  # no float16 build
    assert L.resolve("auto", f16) == "torch"


def test_resolve():
    assert L.resolve("torch", torch.zeros(2, 2)) == "torch"
    assert L.resolve("auto", torch.zeros(2, 2, dtype=torch.float64)) == "torch"
    assert L.resolve("onednn", torch.zeros(2, 2, device="meta")) == "torch"  # not a CPU tensor
    assert L.resolve("packed", torch.zeros(2, 2, device="meta")) == "torch"
    assert L.resolve("packed", torch.zeros(2, 2, dtype=torch.float64)) == "torch"
    with pytest.raises(ValueError, match="linear backend"):
        L.resolve("mkl", torch.zeros(2, 2))


@pytest.mark.parametrize("backend", ["auto", "onednn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 17, 300])
def test_cpu_linears_equal_f_linear(backend, dtype, rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 40, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    x = torch.randn(rows, 40, generator=g).to(dtype)
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}
    # bfloat16 oneDNN needs AVX-512 or AVX-NE-CONVERT: elsewhere it resolves to torch
    want = "packed" if backend == "auto" else "onednn" if L.onednn_available(dtype) else "torch"
    assert L.resolve(backend, w) == want
    # on a CPU with AMX a bfloat16 weight under auto splits by rows (test_amx_split_linear_...)
    made = {"packed": L.AmxSplitLinear if L.amx_splits(backend, w) else L.PackedLinear,
            "onednn": L.OneDNNLinear}.get(want, object)
    assert isinstance(L.make_linear(w, backend=backend), made)
    torch.testing.assert_close(L.make_linear(w, b, backend)(x), F.linear(x, w, b), **tol)
    torch.testing.assert_close(L.make_linear(w, backend=backend)(x[None]), F.linear(x[None], w), **tol)  # [1, T, in]
    xs = torch.randn(rows, 80, generator=g).to(dtype)[:, ::2]  # a strided view
    torch.testing.assert_close(L.make_linear(w, backend=backend)(xs), F.linear(xs, w), **tol)


@pytest.mark.parametrize("amx", [True, False])
def test_amx_split_linear_takes_the_packed_kernel_below_its_rows_and_f_linear_from_them(monkeypatch, amx):
    """auto on a bfloat16 weight: on a CPU with AMX (forced here, so every CPU runs this) calls of
    fewer than AMX_MIN_ROWS rows go to the packed kernel, more to F.linear on the weight itself;
    without AMX, the packed kernel only. Either way the result is F.linear's."""
    monkeypatch.setattr(L, "amx_bf16", lambda: amx)
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(96, 40, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    lin = L.make_linear(w, b)
    assert isinstance(lin, L.AmxSplitLinear if amx else L.PackedLinear)
    assert not isinstance(L.make_linear(w, b, "packed"), L.AmxSplitLinear)  # packed asked for: packed only
    assert not isinstance(L.make_linear(w.float(), b.float()), L.AmxSplitLinear)  # float32: packed
    calls = []
    if amx:
        real = lin.small
        lin.small = lambda x: calls.append(x.shape[0]) or real(x)
    for rows in (1, L.AMX_MIN_ROWS - 1, L.AMX_MIN_ROWS, 300):
        x = torch.randn(rows, 40, generator=g).bfloat16()
        torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=2e-2, atol=5e-2)
    assert calls == ([1, L.AMX_MIN_ROWS - 1] if amx else [])
    with pytest.raises(TypeError, match="bfloat16 weights got torch.float32"):
        L.make_linear(w)(torch.randn(L.AMX_MIN_ROWS, 40))


@pytest.mark.parametrize("backend", ["packed", "onednn"])
def test_cpu_linears_refuse_a_dtype_mismatch(backend):
    with pytest.raises(TypeError, match="float32 weights got torch.float64"):
        L.make_linear(torch.randn(4, 4), backend=backend)(torch.randn(2, 4, dtype=torch.float64))


def test_pack_linears_replaces_forward_keeps_parameters():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8, bias=False))
    x = torch.randn(5, 16)
    want = net(x)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    assert L.pack_linears(L.linears_in(net)) == 2
    assert all(isinstance(m.forward, L.PackedLinear) for m in L.linears_in(net))
    torch.testing.assert_close(net(x), want, rtol=1e-5, atol=1e-5)
    assert L.pack_linears(L.linears_in(net), "onednn") == 2
    assert all(isinstance(m.forward, L.OneDNNLinear) for m in L.linears_in(net))
    torch.testing.assert_close(net(x), want, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    other = nn.Linear(4, 4)
    assert L.pack_linears([other], "torch") == 0 and "forward" not in other.__dict__
    with pytest.raises(TypeError, match="nn.Linear"):
        L.pack_linears([nn.ReLU()])


class _MLP(nn.Module):
    def __init__(self, h: int, i: int):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)


def test_fused_mlps_equal_across_backends():
    torch.manual_seed(1)
    x = torch.randn(9, 24)
    mlp = _MLP(24, 40)
    ref = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    for backend in ("torch", "packed", "onednn"):
        torch.testing.assert_close(GatedMLP.pack(mlp, backend=backend)(x), ref, rtol=1e-5, atol=1e-5)
    experts = nn.ModuleList(_MLP(24, 16) for _ in range(4))
    idx = torch.randint(0, 4, (9, 2))
    w = torch.rand(9, 2)
    ref = torch.zeros_like(x)
    for t in range(9):
        for j in range(2):
            e = experts[int(idx[t, j])]
            ref[t] += w[t, j] * e.down_proj(F.silu(e.gate_proj(x[t])) * e.up_proj(x[t]))
    for backend in ("torch", "packed", "onednn"):
        torch.testing.assert_close(RoutedExperts.pack(experts, backend=backend)(x, idx, w), ref, rtol=1e-5, atol=1e-5)


def test_row_buckets_are_few_and_waste_at_most_an_eighth():
    assert [L.row_bucket(m) for m in (1, 9, 15, 16, 17, 82, 129, 320, 1300, 2048)] == \
        [1, 9, 15, 16, 18, 88, 144, 320, 1408, 2048]
    for m in range(1, 5000):
        b = L.row_bucket(m)
        assert m <= b <= m + m / 8 and L.row_bucket(b) == b  # a bucket is its own bucket
    buckets = L.buckets_up_to(2048)
    assert buckets[0] == 9 and buckets[-1] == 2048 and len(buckets) <= 64
    assert set(buckets) == {L.row_bucket(m) for m in range(9, 2049)}


@pytest.mark.parametrize("shape", [(82, 40), (3, 7, 40), (2, 65, 40)])
def test_padded_rows_give_the_unpadded_result(shape):
    """A call whose rows are not a bucket runs on zero-padded rows: the caller sees exactly its own
    rows, in its own leading shape, contiguous, and equal to ``F.linear``."""
    g = torch.Generator().manual_seed(sum(shape))
    w, b = torch.randn(96, 40, generator=g), torch.randn(96, generator=g)
    x = torch.randn(*shape, generator=g)
    lin = L.OneDNNLinear(w, b)
    rows = x.numel() // 40
    assert L.row_bucket(rows) != rows  # the padded path is the one under test
    got = lin(x)
    assert got.shape == (*shape[:-1], 96) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_warm_buckets_covers_every_new_linear_shape_once():
    """One warm-up call per (bucket, distinct shape not warmed yet): linears of one shape share
    primitives, and a shape warmed once (this process's cache) is not warmed again."""
    L.warm_buckets(100)  # whatever other tests left alive
    shapes = [(33, 25, False), (33, 25, False), (49, 25, True)]  # sizes no other test uses
    lins = [L.OneDNNLinear(torch.randn(o, i), torch.randn(o) if bias else None) for o, i, bias in shapes]
    assert L.warm_buckets(100) == 2 * len(L.buckets_up_to(100))
    assert L.warm_buckets(100) == 0
    assert L.warm_buckets(200) >= 2 * len(L.buckets_up_to(200))  # further: every live shape to the new top
    assert L.warm_buckets(200) == 0
    del lins


def test_warm_buckets_builds_small_step_buckets_for_the_small_thread_count_too():
    from llm_svc.engine.step_threads import StepThreads

    L.warm_buckets(100, StepThreads(large=2, small=1, min_tokens=40))
    keep = L.OneDNNLinear(torch.randn(17, 9))
    before = torch.get_num_threads()
    got = L.warm_buckets(100, StepThreads(large=2, small=1, min_tokens=40))
    # two threads and one (the small steps', and a large step's while a core is taken), every bucket
    assert got == 2 * len(L.buckets_up_to(100))
    keep2 = L.OneDNNLinear(torch.randn(17, 11))
    got = L.warm_buckets(100, StepThreads(large=3, small=2, min_tokens=40))  # 3 and 1 to 100, 2 to 39
    assert got == 2 * len(L.buckets_up_to(100)) + len(L.buckets_up_to(39)) + len(L.buckets_up_to(100))
    del keep2
    assert torch.get_num_threads() == before  # left as it was
    del keep


def test_warm_buckets_builds_the_amx_path_from_its_fewest_rows(monkeypatch):
    """A bfloat16 linear split for AMX (forced here) gets its F.linear primitives built for every
    bucket from AMX_MIN_ROWS rows; its packed half needs none."""
    monkeypatch.setattr(L, "amx_bf16", lambda: True)
    L.warm_buckets(100)
    keep = L.make_linear(torch.randn(23, 13).bfloat16())
    assert isinstance(keep, L.AmxSplitLinear)
    assert L.warm_buckets(100) == len(L.buckets_up_to(100, L.AMX_MIN_ROWS))
    assert L.warm_buckets(100) == 0
    del keep
