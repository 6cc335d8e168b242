"""The fused element-wise kernels (``cpu_fused.c``, ``cpu_gemv.silu_mul``) and the stacked q|k|v
linear against the eager ops they replace: rope and the value scale bit for bit, the residual
add exactly and its RMSNorm to float32 rounding, on odd shapes, row strides and thread counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llm_svc.models import cpu_fused, cpu_gemv
from llm_svc.models.base import apply_rope
from llm_svc.models.linear import fuse_linears

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _tables(t: int, r: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, r, 2).float() / r))
    f = torch.arange(t)[:, None].float() * 37.0 * inv[None]  # far positions: large angles
    emb = torch.cat([f, f], -1)
    return emb.cos(), emb.sin()


def test_kernel_builds_here():
    assert cpu_fused.KERNEL.available()


@pytest.mark.parametrize("t,hq,hk,d,dv,r", [(1, 2, 1, 8, 8, 8), (37, 8, 4, 96, 96, 32), (5, 4, 2, 192, 128, 64),
                                             (130, 3, 3, 16, 24, 2), (9, 1, 1, 10, 6, 10)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("vscale", [1.0, 0.707])
def test_qkv_post_is_bit_identical_to_eager_rope_and_scale(t, hq, hk, d, dv, r, threads, vscale):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(t * 7 + d)
    buf = torch.randn(t, (hq + hk) * d + hk * dv + 5, generator=g) * 4  # a wider row: only the first columns are ours
    qkv = buf[:, :-5]
    cos, sin = _tables(t, r)
    nq, nk = hq * d, hk * d
    q, k, v = qkv[:, :nq].view(t, hq, d), qkv[:, nq:nq + nk].view(t, hk, d), qkv[:, nq + nk:].view(t, hk, dv)
    want = (apply_rope(q, cos, sin), apply_rope(k, cos, sin), v * vscale, buf[:, -5:].clone())
    assert cpu_fused.supports_qkv(qkv, cos, sin)
    cpu_fused.qkv_post(qkv, hq, hk, d, dv, cos, sin, vscale)
    for got, exp in zip((q, k, v, buf[:, -5:]), want, strict=True):
        assert torch.equal(got, exp)


def test_qkv_post_refuses_mismatched_shapes_and_odd_rope():
    buf = torch.zeros(3, 4 * 8)
    cos, sin = _tables(3, 4)
    with pytest.raises(ValueError, match="do not match"):
        cpu_fused.qkv_post(buf, 2, 1, 8, 16, cos, sin)
    cos3, sin3 = cos[:, :3].contiguous(), sin[:, :3].contiguous()
    with pytest.raises(ValueError, match="even"):
        cpu_fused.qkv_post(buf, 2, 1, 8, 8, cos3, sin3)
    assert not cpu_fused.supports_qkv(buf.double(), cos, sin)
    assert not cpu_fused.supports_qkv(buf.t(), cos, sin)


@pytest.mark.parametrize("t,h", [(1, 8), (3, 13), (64, 512), (7, 4096)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("with_add", [True, False])
def test_add_rmsnorm_equals_add_then_rms_norm(t, h, threads, with_add):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(t + h)
    base, y, w = torch.randn(t, h, generator=g) * 3, torch.randn(t, h, generator=g), torch.randn(h, generator=g)
    want_h = base + y if with_add else base.clone()
    want = w * (want_h * torch.rsqrt(want_h.pow(2).mean(-1, keepdim=True) + 1e-6))
    hh = base.clone()
    got = cpu_fused.add_rmsnorm(hh, y if with_add else None, w, 1e-6)
    assert torch.equal(hh, want_h)  # the add is the same float sum, in place
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, F.rms_norm(want_h, (h,), w, 1e-6), rtol=1e-5, atol=1e-5)


def test_add_rmsnorm_refuses_a_residual_of_another_shape():
    with pytest.raises(ValueError, match="does not match"):
        cpu_fused.add_rmsnorm(torch.zeros(2, 8), torch.zeros(2, 4), torch.ones(8), 1e-6)


@pytest.mark.parametrize("t,i", [(1, 1), (4, 256), (33, 100), (600, 64)])
@pytest.mark.parametrize("threads", [1, 2])
def test_silu_mul_equals_silu_times_up(t, i, threads):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(t * i)
    gu = torch.randn(t, 2 * i, generator=g) * 6
    gu[0, 0] = -200.0  # far negative: silu -> -0, no inf / nan from the exponential
    assert cpu_gemv.supports_gated_mul(gu)
    torch.testing.assert_close(cpu_gemv.silu_mul(gu), F.silu(gu[:, :i]) * gu[:, i:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_fused_linears_equal_each_linear_and_keep_one_copy(bias, backend):
    torch.manual_seed(3)
    mods = [nn.Linear(24, n, bias=bias) for n in (32, 16, 8)]
    x = torch.randn(5, 24)
    want = torch.cat([m(x) for m in mods], -1)
    f = fuse_linears(mods, backend)
    torch.testing.assert_close(f(x), want, rtol=1e-5, atol=1e-5)
    assert mods[1].weight.data_ptr() == mods[0].weight.data_ptr() + 32 * 24 * 4  # views of one stacked weight
    torch.testing.assert_close(torch.cat([m(x) for m in mods], -1), want)  # the modules still compute the same
    with pytest.raises(ValueError, match="one input size"):
        fuse_linears([nn.Linear(4, 2), nn.Linear(5, 2)])
