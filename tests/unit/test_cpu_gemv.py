"""The few-row linear kernel (``cpu_gemv.c``) against ``F.linear``: shapes around its register
tiles (2 x 4 of 8-wide vectors on AVX2, 4 x 4 of 16-wide on AVX-512) and K tails, bias, row
strides, thread counts, every vector path this machine can run, and the oneDNN linear handing it
only the calls it should take."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llm_svc.kernels.ckernels import CKernel
from llm_svc.models import cpu_gemv
from llm_svc.models import linear as L

pytestmark = pytest.mark.unit


def test_kernel_builds_here():
    assert cpu_gemv.KERNEL.available()
    assert cpu_gemv.KERNEL.library_path().exists()


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("n,k", [(1, 8), (2, 16), (33, 64), (96, 40), (67, 13), (300, 512)])
@pytest.mark.parametrize("threads", [1, 2])
def test_equals_f_linear(m, n, k, threads, monkeypatch):
    monkeypatch.setattr(cpu_gemv, "_threads", threads)
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w, b, x = torch.randn(n, k, generator=g), torch.randn(n, generator=g), torch.randn(m, k, generator=g)
    torch.testing.assert_close(cpu_gemv.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(cpu_gemv.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


# the narrower paths, built on this machine with the wider ISAs switched off
_ISAS = {"avx2": ("-mno-avx512f",), "scalar": ("-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-avx")}


@pytest.mark.parametrize("isa", sorted(_ISAS))
def test_every_vector_path_equals_f_linear(isa):
    """The machine's own build takes one path (AVX-512 here when the CPU has it); the others are
    built beside it so each stays right on whatever CPU runs the service."""
    kernel = CKernel(cpu_gemv.SOURCE, f"cpu_gemv_test_{isa}", cpu_gemv._bind, what="test build", fallback="none",
                     flags=cpu_gemv.KERNEL.flags + _ISAS[isa], link_flags=cpu_gemv.KERNEL.link_flags)
    lib = kernel.load()
    assert lib is not None
    g = torch.Generator().manual_seed(7)
    for m, n, k in [(1, 1, 8), (3, 33, 64), (4, 67, 13), (5, 96, 40), (8, 300, 512), (2, 5, 17)]:
        w, b, x = torch.randn(n, k, generator=g), torch.randn(n, generator=g), torch.randn(m, k, generator=g)
        out = torch.empty(m, n)
        assert lib.mmserve_gemv_f32(x.data_ptr(), k, w.data_ptr(), b.data_ptr(), out.data_ptr(), n, m, n, k, 1) == 0
        torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_leading_dims_and_row_strides():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 24, generator=g)
    x = torch.randn(2, 3, 24, generator=g)
    torch.testing.assert_close(cpu_gemv.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    rows = torch.randn(5, 48, generator=g)[:, 8:32]  # row stride 48, unit stride inside a row
    assert cpu_gemv.supports(rows, w)
    torch.testing.assert_close(cpu_gemv.linear(rows, w), F.linear(rows, w), rtol=1e-5, atol=1e-4)


def test_supports_only_few_float32_rows(monkeypatch):
    w = torch.randn(16, 8)
    monkeypatch.setattr(cpu_gemv, "_threads", torch.get_num_threads())
    assert cpu_gemv.supports(torch.randn(cpu_gemv.MAX_ROWS, 8), w)
    assert not cpu_gemv.supports(torch.randn(cpu_gemv.MAX_ROWS + 1, 8), w)
    monkeypatch.setattr(cpu_gemv, "_threads", torch.get_num_threads() + 1)  # torch on fewer threads: a decode step
    assert cpu_gemv.supports(torch.randn(cpu_gemv.MAX_ROWS_FEW_THREADS, 8), w)
    assert not cpu_gemv.supports(torch.randn(cpu_gemv.MAX_ROWS_FEW_THREADS + 1, 8), w)
    assert not cpu_gemv.supports(torch.randn(2, 8, dtype=torch.float64), w)
    assert not cpu_gemv.supports(torch.randn(2, 16)[:, ::2], w)
    assert not cpu_gemv.supports(torch.randn(0, 8), w)
    assert not cpu_gemv.supports(torch.randn(2, 8), torch.randn(8, 16).t())  # a transposed weight


def test_onednn_linear_takes_few_rows_here_and_many_to_onednn(monkeypatch):
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(64, 32, generator=g), torch.randn(64, generator=g)
    lin = L.make_linear(w, b, backend="onednn")
    calls = []
    real = cpu_gemv.linear
    monkeypatch.setattr(cpu_gemv, "linear", lambda *a: calls.append(a[0].shape) or real(*a))
    monkeypatch.setattr(cpu_gemv, "_threads", torch.get_num_threads())
    for m in (1, 4, 8, 9, 100):
        x = torch.randn(m, 32, generator=g)
        torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    assert calls == [torch.Size([1, 32]), torch.Size([4, 32]), torch.Size([8, 32])]


def test_no_compiler_leaves_the_onednn_path(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("MMSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(cpu_gemv, "KERNEL", CKernel(cpu_gemv.SOURCE, "cpu_gemv", cpu_gemv._bind, what="gemv",
                                                   fallback="oneDNN"))
    with caplog.at_level("WARNING"):
        assert not cpu_gemv.supports(torch.randn(2, 8), torch.randn(4, 8))
    assert "unavailable" in caplog.text
    w = torch.randn(4, 8)
    x = torch.randn(2, 8)
    torch.testing.assert_close(L.make_linear(w, backend="onednn")(x), F.linear(x, w), rtol=1e-5, atol=1e-4)


def _moe_loop(x, idx, w, gate_up, down):
    out = torch.zeros_like(x)
    i = gate_up.shape[1] // 2
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            h = F.linear(x[t], gate_up[e])
            out[t] += w[t, k] * F.linear(F.silu(h[:i]) * h[i:], down[e])
    return out


@pytest.mark.parametrize("t,k,e,h,i", [(1, 1, 1, 8, 4), (1, 2, 8, 64, 32), (4, 2, 8, 96, 40), (5, 3, 6, 33, 17),
                                       (16, 2, 8, 128, 64), (3, 8, 8, 40, 24)])
@pytest.mark.parametrize("threads", [1, 2])
def test_routed_experts_kernel_equals_the_per_pair_loop(t, k, e, h, i, threads, monkeypatch):
    """Experts chosen by several tokens, by one, by none; every K; one and two threads; large
    negative gate values (the activation's exp kept finite)."""
    monkeypatch.setattr(cpu_gemv, "_threads", threads)
    g = torch.Generator().manual_seed(t * 100 + k * 10 + e)
    gate_up, down = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    x = torch.randn(t, h, generator=g) * 4  # gate values of +-100 and more
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if k <= e else None
    w = torch.rand(t, k, generator=g)
    assert cpu_gemv.supports_moe(x, gate_up, down)
    got = cpu_gemv.moe(x, idx, w, gate_up, down)
    want = _moe_loop(x, idx, w, gate_up, down)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_routed_experts_kernel_result_does_not_depend_on_threads(monkeypatch):
    g = torch.Generator().manual_seed(3)
    gate_up, down = torch.randn(8, 64, 48, generator=g), torch.randn(8, 48, 32, generator=g)
    x, w = torch.randn(12, 48, generator=g), torch.rand(12, 2, generator=g)
    idx = torch.randint(0, 8, (12, 2), generator=g)  # a token may choose one expert twice
    outs = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(cpu_gemv, "_threads", threads)
        outs.append(cpu_gemv.moe(x, idx, w, gate_up, down))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    torch.testing.assert_close(outs[0], _moe_loop(x, idx, w, gate_up, down), rtol=1e-5, atol=1e-4)


def test_routed_experts_kernel_refuses_what_it_cannot_run():
    gate_up, down = torch.randn(4, 16, 8), torch.randn(4, 8, 8)
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="expert index"):
        cpu_gemv.moe(x, torch.tensor([[0], [4]]), torch.ones(2, 1), gate_up, down)
    assert not cpu_gemv.supports_moe(torch.randn(cpu_gemv.MOE_MAX_TOKENS + 1, 8), gate_up, down)
    assert not cpu_gemv.supports_moe(x.double(), gate_up, down)
    assert not cpu_gemv.supports_moe(x, gate_up.transpose(1, 2), down)
    assert not cpu_gemv.supports_moe(torch.randn(0, 8), gate_up, down)


def _route_torch(x, weight, bias, k, norm, scale):
    scores = F.linear(x, weight).sigmoid()
    idx = (scores + (0 if bias is None else bias)).topk(k, dim=-1)[1]
    w = scores.gather(1, idx)
    if norm:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return idx, w * scale


@pytest.mark.parametrize("t,e,k,h", [(1, 8, 2, 64), (4, 8, 2, 512), (16, 64, 6, 40), (3, 5, 5, 17), (2, 256, 8, 24),
                                     (37, 8, 2, 64), (300, 16, 4, 96)])  # a prefill's tokens: blocks of 16
@pytest.mark.parametrize("norm,bias", [(True, True), (False, False)])
@pytest.mark.parametrize("threads", [1, 2])
def test_router_kernel_equals_torch(t, e, k, h, norm, bias, threads, monkeypatch):
    monkeypatch.setattr(cpu_gemv, "_threads", threads)
    g = torch.Generator().manual_seed(t * 7 + e + k)
    x, weight = torch.randn(t, h, generator=g), torch.randn(e, h, generator=g) / h ** 0.5
    b = torch.randn(e, generator=g) * 0.1 if bias else None
    assert cpu_gemv.supports_route(x, weight)
    idx, w = cpu_gemv.route(x, weight, b, k, norm, 2.5)
    want_idx, want_w = _route_torch(x, weight, b, k, norm, 2.5)
    assert torch.equal(idx, want_idx)
    torch.testing.assert_close(w, want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("t", [1, 16, 300])
def test_router_kernel_takes_a_bfloat16_model(t):
    """A model served at bfloat16: x and the router weight bfloat16, scored in float32 as the eager
    router does (``F.linear(x.float(), weight.float())``): the same experts, float32 weights."""
    g = torch.Generator().manual_seed(t)
    x, weight = torch.randn(t, 512, generator=g).bfloat16(), (torch.randn(8, 512, generator=g) / 512 ** 0.5).bfloat16()
    b = torch.randn(8, generator=g) * 0.1
    assert cpu_gemv.supports_route(x, weight)
    assert not cpu_gemv.supports_route(x, weight.float())  # mixed dtypes stay on the eager path
    idx, w = cpu_gemv.route(x, weight, b, 2, True, 2.5)
    want_idx, want_w = _route_torch(x.float(), weight.float(), b, 2, True, 2.5)
    assert w.dtype == torch.float32 and torch.equal(idx, want_idx)
    torch.testing.assert_close(w, want_w, rtol=1e-5, atol=1e-6)


def test_router_kernel_refuses_what_it_cannot_run():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="top_k"):
        cpu_gemv.route(x, torch.randn(4, 8), None, 5, True, 1.0)
    assert not cpu_gemv.supports_route(x, torch.randn(257, 8))
    assert not cpu_gemv.supports_route(x.double(), torch.randn(4, 8))
    assert not cpu_gemv.supports_route(torch.randn(0, 8), torch.randn(4, 8))
    assert cpu_gemv.supports_route(torch.randn(cpu_gemv.MOE_MAX_TOKENS_ALL_THREADS + 1, 8), torch.randn(4, 8))


def test_pool_results_do_not_depend_on_threads_and_helpers_start_once(monkeypatch):
    """The elastic pool splits a weight's row blocks between the caller and its helpers: every
    thread count gives the bit-identical result, and helpers are started once, up to the count."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 512, generator=g)
    w = torch.randn(1000, 512, generator=g)  # 32 blocks of 32 rows, the last one short
    monkeypatch.setattr(cpu_gemv, "_threads", 1)
    ref = cpu_gemv.linear(x, w)
    lib = cpu_gemv.KERNEL.load()
    for threads in (2, 3, 4, 2):
        monkeypatch.setattr(cpu_gemv, "_threads", threads)
        for _ in range(20):  # many generations: a stale helper never runs a later job's chunk
            assert torch.equal(cpu_gemv.linear(x, w), ref)
    assert lib.mmserve_pool_helpers() == 3
    gu = torch.randn(6, 2 * 64, 128, generator=g)
    dn = torch.randn(6, 128, 64, generator=g)
    xs = torch.randn(8, 128, generator=g)
    idx = torch.randint(0, 6, (8, 2), generator=g)
    wts = torch.rand(8, 2, generator=g)
    monkeypatch.setattr(cpu_gemv, "_threads", 1)
    moe_ref = cpu_gemv.moe(xs, idx, wts, gu, dn)
    monkeypatch.setattr(cpu_gemv, "_threads", 4)
    assert torch.equal(cpu_gemv.moe(xs, idx, wts, gu, dn), moe_ref)


def test_pool_serves_concurrent_callers_and_a_forked_child(monkeypatch):
    """Two Python threads calling at once (the second runs its own call serially) and a child
    forked after the helpers started (it has none: it starts its own) all get exact results."""
    import os
    import threading

    g = torch.Generator().manual_seed(6)
    ws = [torch.randn(768, 512, generator=g) for _ in range(2)]
    xs = [torch.randn(3, 512, generator=g) for _ in range(2)]
    monkeypatch.setattr(cpu_gemv, "_threads", 1)
    refs = [cpu_gemv.linear(x, w) for x, w in zip(xs, ws)]
    monkeypatch.setattr(cpu_gemv, "_threads", 2)
    bad = []

    def hammer(j: int) -> None:
        for _ in range(200):
            if not torch.equal(cpu_gemv.linear(xs[j], ws[j]), refs[j]):
                bad.append(j)

    threads = [threading.Thread(target=hammer, args=(j,)) for j in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == []
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 only if its calls are exact
        ok = all(torch.equal(cpu_gemv.linear(xs[0], ws[0]), refs[0]) for _ in range(20))
        os._exit(0 if ok and cpu_gemv.KERNEL.load().mmserve_pool_helpers() == 1 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_routed_experts_kernel_takes_a_short_prompt_only_with_every_thread(monkeypatch):
    """Up to ``MOE_MAX_TOKENS_ALL_THREADS`` tokens run here while the kernel has at least torch's
    threads (and more than one), ``MOE_MAX_TOKENS`` otherwise; such a chunk equals the loop."""
    g = torch.Generator().manual_seed(9)
    t, e, h, i = 150, 6, 64, 32
    gate_up, down = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    x = torch.randn(t, h, generator=g)
    idx = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(t)])
    w = torch.rand(t, 2, generator=g)
    monkeypatch.setattr(cpu_gemv, "_threads", 1)
    assert not cpu_gemv.supports_moe(x, gate_up, down)
    monkeypatch.setattr(cpu_gemv, "_threads", max(2, torch.get_num_threads()))
    assert cpu_gemv.supports_moe(x, gate_up, down)
    assert not cpu_gemv.supports_moe(torch.randn(cpu_gemv.MOE_MAX_TOKENS_ALL_THREADS + 1, h), gate_up, down)
    want = torch.zeros(t, h)
    for r in range(t):
        for j in range(2):
            gu = gate_up[idx[r, j]] @ x[r]
            want[r] += w[r, j] * (down[idx[r, j]] @ (torch.nn.functional.silu(gu[:i]) * gu[i:]))
    torch.testing.assert_close(cpu_gemv.moe(x, idx, w, gate_up, down), want, rtol=1e-4, atol=1e-3)
