"""bfloat16-activation builds of the non-linear C kernels (``act_elem.h``, ``-DACT_BF16``) against
the float32 kernels and the eager bfloat16 ops, on bfloat16 inputs, on both conversion paths
(AVX-512 BF16 where this CPU has it, and the portable one, built here with ``-mno-avx512bf16``).

Tolerances, and why:
* rope and the value scale (``qkv_post``): bit-identical to eager bfloat16 (each op rounded as
  torch rounds it);
* add + RMSNorm: the add bit-identical; the norm within one bfloat16 ulp of
  ``mimo_blocks.RMSNorm`` at bfloat16 (its float32 sum of squares runs in another order);
* attention (decode, prefill): the kernel computes in float32 whatever the activations' dtype,
  so the bfloat16 build's output is the float32 build's output on the same (widened) inputs,
  rounded to bfloat16: equal within one bfloat16 rounding (rtol 2^-8);
* the KV write: rows rounded to the pool's dtype exactly as torch's ``copy_`` rounds them.
"""

from __future__ import annotations

import pytest
import torch

from llm_svc.attention import AttentionParams, LayerKV, cpu_paged, cpu_prefill
from llm_svc.kernels.ckernels import CKernel, act_path
from llm_svc.models import cpu_fused
from llm_svc.models.base import apply_rope
from llm_svc.models.mimo_blocks import RMSNorm

pytestmark = pytest.mark.unit
BF = torch.bfloat16
ONE_ROUNDING = dict(rtol=2 ** -8, atol=1e-6)  # one bfloat16 rounding of the float32 result


def _has_bf16_instructions() -> bool:
    try:
        return "avx512_bf16" in open("/proc/cpuinfo").read()
    except OSError:
        return False


def _portable(kernel: CKernel) -> CKernel:
    """The same build without the AVX-512 BF16 instructions (the portable conversions)."""
    return CKernel(kernel.source, kernel.name + "_nobf16i", kernel.bind, what=kernel.what + " (portable)",
                   fallback="none", flags=kernel.flags + ("-mno-avx512bf16",), headers=kernel.headers)


@pytest.fixture(params=["native", "portable"])
def path(request, monkeypatch):
    """Runs a test on this machine's bfloat16 builds, then on the portable ones."""
    if request.param == "portable":
        monkeypatch.setitem(cpu_fused.KERNELS, BF, _portable(cpu_fused.KERNELS[BF]))
        for mod in (cpu_paged, cpu_prefill):
            for key in [k for k in mod.ACT_KERNELS if BF in k]:  # bf16 activations or a bf16 pool
                monkeypatch.setitem(mod.ACT_KERNELS, key, _portable(mod.ACT_KERNELS[key]))
            if BF in getattr(mod, "KERNELS", {}):  # float32 activations' builds, by pool dtype
                monkeypatch.setitem(mod.KERNELS, BF, mod.ACT_KERNELS[(torch.float32, BF)])
        cpu_prefill.tile_rows.cache_clear()
    yield request.param
    cpu_prefill.tile_rows.cache_clear()


def test_builds_say_which_path_they_took(path):
    want = "bfloat16/avx512_bf16" if path == "native" and _has_bf16_instructions() else "bfloat16/portable"
    assert act_path(cpu_fused.KERNELS[BF]) == want
    assert act_path(cpu_paged.ACT_KERNELS[(BF, BF)]) == want
    assert act_path(cpu_prefill.ACT_KERNELS[(BF, torch.float32)]) == want
    assert act_path(cpu_fused.KERNEL) == "float32"


# ---------------------------------------------------------------- qkv_post, add_rmsnorm

def _tables(t: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, r, 2).float() / r))
    f = torch.arange(t)[:, None].float() * 37.0 * inv[None]
    emb = torch.cat([f, f], -1)
    return emb.cos().to(BF), emb.sin().to(BF)


@pytest.mark.parametrize("t,hq,hk,d,dv,r", [(1, 2, 1, 8, 8, 8), (37, 8, 4, 96, 96, 32), (5, 4, 2, 192, 128, 64),
                                             (17, 3, 3, 16, 24, 2), (9, 1, 1, 10, 6, 10), (3, 2, 1, 512, 40, 300)])
@pytest.mark.parametrize("vscale", [1.0, 0.707])
def test_qkv_post_bf16_is_bit_identical_to_eager_bf16(path, t, hq, hk, d, dv, r, vscale):
    g = torch.Generator().manual_seed(t * 7 + d)
    buf = (torch.randn(t, (hq + hk) * d + hk * dv + 5, generator=g) * 4).to(BF)
    qkv = buf[:, :-5]
    cos, sin = _tables(t, r)
    nq, nk = hq * d, hk * d
    q, k, v = qkv[:, :nq].view(t, hq, d), qkv[:, nq:nq + nk].view(t, hk, d), qkv[:, nq + nk:].view(t, hk, dv)
    want = (apply_rope(q, cos, sin), apply_rope(k, cos, sin), v * vscale, buf[:, -5:].clone())
    assert cpu_fused.supports_qkv(qkv, cos, sin)
    cpu_fused.qkv_post(qkv, hq, hk, d, dv, cos, sin, vscale)
    for got, exp in zip((q, k, v, buf[:, -5:]), want, strict=True):
        assert got.dtype == BF and torch.equal(got, exp)


def test_mixed_dtypes_are_not_fused():
    buf = torch.zeros(3, 32, dtype=BF)
    cos, sin = _tables(3, 4)
    assert not cpu_fused.supports_qkv(buf, cos.float(), sin.float())
    assert not cpu_fused.supports_norm(buf, torch.ones(32))
    with pytest.raises(ValueError, match="does not match"):
        cpu_fused.add_rmsnorm(buf, torch.zeros(3, 32), torch.ones(32, dtype=BF), 1e-6)


@pytest.mark.parametrize("t,h", [(1, 8), (3, 13), (64, 512), (7, 4096), (5, 300)])
@pytest.mark.parametrize("with_add", [True, False])
def test_add_rmsnorm_bf16_equals_the_bf16_module(path, t, h, with_add):
    g = torch.Generator().manual_seed(t + h)
    base = (torch.randn(t, h, generator=g) * 3).to(BF)
    y = torch.randn(t, h, generator=g).to(BF)
    norm = RMSNorm(h, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(h, generator=g))
    norm = norm.to(BF)
    want_h = base + y if with_add else base.clone()
    want = norm(want_h)
    hh = base.clone()
    assert cpu_fused.supports_norm(hh, norm.weight)
    got = cpu_fused.add_rmsnorm(hh, y if with_add else None, norm.weight.data, 1e-6)
    assert torch.equal(hh, want_h)  # the bfloat16 add, rounded as eager rounds it
    assert got.dtype == BF
    # within one bfloat16 ulp of each value (the mean's float32 sum runs in another order)
    ulp = torch.ldexp(torch.ones_like(want.float()), torch.frexp(want.float().abs())[1] - 8)
    assert ((got.float() - want.float()).abs() <= ulp).all()
    assert (got == want).float().mean() > 0.95


@pytest.mark.parametrize("with_add", [False, True])
def test_add_rmsnorm_with_a_float32_weight_equals_gemma3s_norm_at_bf16(path, with_add):
    """Gemma3RMSNorm at bfloat16 normalizes and multiplies by (1 + weight) in float32 and rounds
    once: the kernel given that float32 weight does the same (within an ulp: the mean's sum order)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    t, h = 19, 72
    g = torch.Generator().manual_seed(h)
    base, y = (torch.randn(t, h, generator=g) * 3).to(BF), torch.randn(t, h, generator=g).to(BF)
    norm = Gemma3RMSNorm(h, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(h, generator=g) * 0.5)
    norm = norm.to(BF)
    want_h = base + y if with_add else base.clone()
    want = norm(want_h)
    w1 = (1.0 + norm.weight.detach().float()).contiguous()
    hh = base.clone()
    assert cpu_fused.supports_norm_w32(hh, w1) and not cpu_fused.supports_norm(hh, w1)
    got = cpu_fused.add_rmsnorm(hh, y if with_add else None, w1, 1e-6)
    assert torch.equal(hh, want_h) and got.dtype == BF
    ulp = torch.ldexp(torch.ones_like(want.float()), torch.frexp(want.float().abs())[1] - 8)
    assert ((got.float() - want.float()).abs() <= ulp).all()
    assert (got == want).float().mean() > 0.95


# ---------------------------------------------------------------- paged decode

def _pool(g, hkv, slots, d, dtype):
    return torch.randn(hkv, slots, d, generator=g).to(dtype)


@pytest.mark.parametrize("kv_dtype", [torch.float32, BF, torch.float16])
@pytest.mark.parametrize("dims", [(24, 16), (96, 96), (192, 128), (40, 40), (8, 6)])
def test_paged_decode_bf16_equals_float32_kernel(path, kv_dtype, dims):
    dqk, dv = dims
    g = torch.Generator().manual_seed(dqk + dv)
    hq, hkv = 8, 2
    lens = [1, 2, 7, 511, 513, 1300]
    cap = max(lens) + 64
    rows = len(lens) + 2
    n = rows * cap + 7
    cache = LayerKV(_pool(g, hkv, n, dqk, kv_dtype), _pool(g, hkv, n, dv, kv_dtype))
    table = torch.randperm(n, generator=g)[: rows * cap].view(rows, cap).contiguous()
    trows = torch.randperm(rows, generator=g)[: len(lens)]
    k0 = torch.randint(0, 60, (len(lens),), generator=g)
    q = torch.randn(len(lens), hq, dqk, generator=g).to(BF)
    params = AttentionParams(scale=dqk ** -0.5, sinks=torch.randn(hq, generator=g))
    assert cpu_paged.supports(q, cache)
    got = cpu_paged.paged_decode(q, cache, table, trows, k0, torch.tensor(lens), params)
    want = cpu_paged.paged_decode(q.float(), cache, table, trows, k0, torch.tensor(lens), params)
    assert got.dtype == BF and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, **ONE_ROUNDING)
    for threads in (2, 3):  # split over threads: the same rows
        assert torch.equal(cpu_paged.paged_decode(q, cache, table, trows, k0, torch.tensor(lens), params,
                                                  threads=threads), got)


# ---------------------------------------------------------------- the KV write

@pytest.mark.parametrize("kv_dtype", [torch.float32, BF, torch.float16])
@pytest.mark.parametrize("act_dtype", [torch.float32, BF])
@pytest.mark.parametrize("d,dv", [(96, 96), (192, 128), (8, 300)])
def test_kv_write_rounds_rows_as_torch_copy(path, kv_dtype, act_dtype, d, dv):
    g = torch.Generator().manual_seed(d + dv)
    hkv, t = 3, 11
    cache = LayerKV(torch.zeros(hkv, 64, d, dtype=kv_dtype), torch.zeros(hkv, 64, dv, dtype=kv_dtype))
    ref = LayerKV(cache.k.clone(), cache.v.clone())
    rows = torch.randn(t, hkv * (d + dv) + 4, generator=g).to(act_dtype)  # k | v | more, as a fused projection's
    k = rows[:, :hkv * d].view(t, hkv, d)
    v = rows[:, hkv * d:hkv * (d + dv)].view(t, hkv, dv)
    slots = torch.randperm(64, generator=g)[:t]
    assert cpu_paged.supports_write(cache, k, v)
    cpu_paged.write(cache, slots, k, v)
    ref.k[:, slots] = k.transpose(0, 1).to(kv_dtype)
    ref.v[:, slots] = v.transpose(0, 1).to(kv_dtype)
    assert torch.equal(cache.k, ref.k) and torch.equal(cache.v, ref.v)
    with pytest.raises(IndexError):
        cpu_paged.write(cache, torch.full((t,), 64), k, v)


def test_kv_write_rounds_special_values_as_torch_copy(path):
    """The vectorised rounding (8 lanes on AVX2, the scalar form for the tail) on the values where
    rounding is delicate: ties to even both ways, carries into the exponent, overflow to infinity,
    infinities, zeros of both signs, float32 subnormals (kept, as torch keeps them, on the
    portable path only: the AVX-512 BF16 instruction flushes them)."""
    bits = [0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3FFFFFFF, 0x7F7FFFFF, 0x7F7F7FFF, 0x7F800000, 0xFF800000,
            0x00000000, 0x80000000, 0xBF808001, 0xC0FF8000, 0x3F800001, 0x477FE000]
    if path == "portable" or not _has_bf16_instructions():
        bits += [0x00000001, 0x807FFFFF, 0x00408000]
    vals = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    d = 24
    flat = vals.repeat(-(-d * 2 // len(vals)))[:2 * d]
    cache = LayerKV(torch.zeros(1, 4, d, dtype=BF), torch.zeros(1, 4, d, dtype=BF))
    k, v = flat[:d].view(1, 1, d), flat[d:].view(1, 1, d)
    cpu_paged.write(cache, torch.tensor([2]), k, v)
    assert torch.equal(cache.k[0, 2].view(torch.int16), k[0, 0].to(BF).view(torch.int16))
    assert torch.equal(cache.v[0, 2].view(torch.int16), v[0, 0].to(BF).view(torch.int16))


# ---------------------------------------------------------------- paged prefill

@pytest.mark.parametrize("kv_dtype", [torch.float32, BF])
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("hq,hkv,dqk,dv", [(8, 2, 96, 96), (6, 2, 40, 29), (4, 4, 64, 64)])
def test_paged_prefill_bf16_equals_float32_kernel(path, kv_dtype, window, hq, hkv, dqk, dv):
    g = torch.Generator().manual_seed(hq * 100 + dqk + (window or 0))
    members = [(70, 0, 0), (53, 101, 0 if window is None else 101 - window + 1), (1, 30, 0), (9, 0, 0)]
    cap = max(p + n for n, p, _ in members) + 40
    rows = len(members) + 2
    n = rows * cap + 11
    cache = LayerKV(_pool(g, hkv, n, dqk, kv_dtype), _pool(g, hkv, n, dv, kv_dtype))
    table = torch.randperm(n, generator=g)[: rows * cap].view(rows, cap).contiguous()
    trows = torch.randperm(rows, generator=g)[: len(members)]
    nq = max(m[0] for m in members)
    q = torch.randn(len(members), nq, hq, dqk, generator=g).to(BF)
    ns = torch.tensor([m[0] for m in members])
    qpos0 = torch.tensor([m[1] for m in members])
    k0 = torch.tensor([m[2] for m in members])
    params = AttentionParams(scale=dqk ** -0.5, sinks=torch.randn(hq, generator=g))
    assert cpu_prefill.supports(q, cache, params)
    got = cpu_prefill.paged_prefill(q, cache, table, trows, k0, qpos0, ns, window, params, threads=1)
    want = cpu_prefill.paged_prefill(q.float(), cache, table, trows, k0, qpos0, ns, window, params, threads=1)
    assert got.dtype == BF
    torch.testing.assert_close(got.float(), want, **ONE_ROUNDING)
    assert torch.equal(cpu_prefill.paged_prefill(q, cache, table, trows, k0, qpos0, ns, window, params, threads=2),
                       got)
