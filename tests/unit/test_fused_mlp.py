"""Fused gated MLPs and routed experts equal the modules they replace, bit for bit where the
arithmetic is the same (fp32), and keep one copy of the weights."""

import pytest
import torch
from torch import nn

from llm_svc.models.fused_mlp import GatedMLP, RoutedExperts

pytestmark = pytest.mark.unit


class _MLP(nn.Module):
    def __init__(self, h, i):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def _loop_moe(experts, x, idx, w):
    """The per-expert reference (mmserve's published-tree MoE.forward)."""
    out = torch.zeros_like(x)
    for e in idx.unique().tolist():
        tok, slot = (idx == e).nonzero(as_tuple=True)
        out.index_add_(0, tok, experts[e](x[tok]) * w[tok, slot, None])
    return out


def test_gated_mlp_equals_the_module_and_shares_its_weights():
    torch.manual_seed(0)
    mlp = _MLP(32, 48)
    x = torch.randn(7, 32)
    want = mlp(x)
    fused = GatedMLP.pack(mlp)
    torch.testing.assert_close(fused(x), want, atol=1e-6, rtol=1e-6)
    assert mlp.gate_proj.weight.data_ptr() == fused.gate_up.data_ptr()  # a view, not a copy
    torch.testing.assert_close(mlp(x), want)  # the module still computes the same after rebinding


@pytest.mark.parametrize("tokens", [1, 3, 16, 200])
def test_routed_experts_equal_the_per_expert_loop(tokens):
    torch.manual_seed(tokens)
    experts = nn.ModuleList(_MLP(32, 16) for _ in range(6))
    x = torch.randn(tokens, 32)
    idx = torch.stack([torch.randperm(6)[:2] for _ in range(tokens)])  # [T, 2] distinct experts
    w = torch.rand(tokens, 2)
    want = _loop_moe(experts, x, idx, w)
    fused = RoutedExperts.pack(experts)
    torch.testing.assert_close(fused(x, idx, w), want, atol=1e-6, rtol=1e-6)
    assert experts[3].down_proj.weight.data_ptr() == fused.down[3].data_ptr()
    # the routing matters: another choice of experts gives another result
    assert not torch.allclose(fused(x, idx.flip(1).roll(1, 0), w), want) or tokens == 1


@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_grouped_experts_path_equals_the_per_expert_loop(tokens):
    """The path a CUDA graph records (no host sync: groups ended by ``searchsorted``, two
    ``torch._grouped_mm``), run on the CPU: the same product, experts with no token included."""
    torch.manual_seed(10 + tokens)
    experts = nn.ModuleList(_MLP(32, 16) for _ in range(8))
    x = torch.randn(tokens, 32)
    idx = torch.stack([torch.randperm(5)[:2] + 2 for _ in range(tokens)])  # experts 0, 1 and 7 idle
    w = torch.rand(tokens, 2)
    want = _loop_moe(experts, x, idx, w)
    fused = RoutedExperts.pack(experts)
    with torch.inference_mode():
        got = fused.grouped(x, idx, w)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(fused.grouped(x, idx.flip(1).roll(1, 0), w), want) or tokens == 1


def test_routed_experts_equal_transformers_stacked_experts():
    from transformers.models.mimo_v2_flash.configuration_mimo_v2_flash import MiMoV2FlashConfig
    from transformers.models.mimo_v2_flash.modeling_mimo_v2_flash import MiMoV2FlashExperts

    torch.manual_seed(1)
    cfg = MiMoV2FlashConfig(hidden_size=32, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2)
    hf = MiMoV2FlashExperts(cfg)
    with torch.no_grad():
        hf.gate_up_proj.normal_()
        hf.down_proj.normal_()
    x = torch.randn(11, 32)
    idx = torch.stack([torch.randperm(hf.num_experts)[:2] for _ in range(11)])
    w = torch.rand(11, 2)
    with torch.no_grad():  # as the engine runs it (inference mode)
        want = hf(x, idx, w)
        got = RoutedExperts.pack(hf)(x, idx, w)
    # N(0, 1) weights give outputs of magnitude ~300: float32 sums in another order (the few-row
    # kernel's vector width) differ by a few ulps of that, so the absolute bound scales with it
    torch.testing.assert_close(got, want, atol=1e-6 * float(want.abs().max()), rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 4, 37, 2000])
def test_native_rms_norm_fused_equals_its_reference(rows):
    """The float32 path (one fused op) against the module's own upcast formula, which bf16 keeps."""
    from llm_svc.models.mimo_native import RMSNorm

    torch.manual_seed(rows)
    norm = RMSNorm(512, 1e-6)
    with torch.no_grad():
        norm.weight.normal_()
        x = torch.randn(rows, 512) * 3
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
        torch.testing.assert_close(norm(x), norm.weight * h, rtol=1e-6, atol=1e-6)
        xb = x.bfloat16()
        norm_b = RMSNorm(512, 1e-6).bfloat16()
        hb = xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        assert torch.equal(norm_b(xb), norm_b.weight * hb.to(torch.bfloat16))


def test_tanh_gelu_mlps_take_the_fused_pass_and_equal_the_module():
    """Gemma's MLPs (transformers' ``gelu_pytorch_tanh``): the activation and the product in one
    C pass, as close to float64 as torch's own gelu (gates from tiny to saturated, both signs)."""
    from transformers.activations import ACT2FN

    from llm_svc.models import cpu_gemv
    from llm_svc.models.fused_mlp import _gated, act_kind

    act = ACT2FN["gelu_pytorch_tanh"]
    assert act_kind(act) == "gelu_tanh" and act_kind(nn.GELU(approximate="tanh")) == "gelu_tanh"
    assert act_kind(nn.GELU()) is None and act_kind(nn.functional.silu) == "silu"
    torch.manual_seed(3)
    for scale in (0.01, 1.0, 8.0, 40.0):
        gu = torch.randn(33, 2 * 96) * scale
        gate, up = gu.chunk(2, dim=-1)
        exact = (nn.functional.gelu(gate.double(), approximate="tanh") * up.double())
        torch_err = ((act(gate) * up).double() - exact).abs().max()
        got = cpu_gemv.gelu_tanh_mul(gu)
        assert torch.equal(_gated(gu, act, "gelu_tanh"), got)
        # within torch's own error, or 4 float32 ulps of the value (AVX2's division is approximate
        # under -ffast-math); no cancellation where the gelu vanishes (g = -20, u = 22 gave -3e-5)
        assert ((got.double() - exact).abs() <= 2 * torch_err + 4 * 1.2e-7 * exact.abs()).all()
    mlp = _MLP(32, 48)
    mlp.act_fn = act
    x = torch.randn(9, 32)
    fused = GatedMLP.pack(mlp)
    assert fused._act == "gelu_tanh"
    want = mlp.down_proj(act(mlp.gate_proj(x)) * mlp.up_proj(x))
    torch.testing.assert_close(fused(x), want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("amx", [True, False])
def test_bf16_experts_on_amx_run_many_rows_expert_by_expert_and_few_in_the_packed_call(monkeypatch, amx):
    """bfloat16 experts under auto: on a CPU with AMX (forced here, so every CPU runs this) a call
    whose experts average AMX_MIN_ROWS rows goes expert by expert through F.linear (oneDNN's AMX
    GEMM), a smaller one to the one packed C call; without AMX, always the packed call. Both
    equal the per-expert loop within bfloat16 rounding."""
    from llm_svc.models import cpu_packed, fused_mlp, linear

    monkeypatch.setattr(linear, "amx_bf16", lambda: amx)
    packed_calls = []
    real = cpu_packed.moe_w
    monkeypatch.setattr(cpu_packed, "moe_w", lambda *a, **k: packed_calls.append(a[0].shape[0]) or real(*a, **k))
    torch.manual_seed(7)
    experts = nn.ModuleList(_MLP(64, 32) for _ in range(4)).bfloat16()
    fused = RoutedExperts.pack(experts)
    assert fused.packed is not None  # bfloat16 experts this shape pack
    many = 2 * fused_mlp.AMX_MIN_ROWS * 4  # tokens x 2 choices over 4 experts: 2 x AMX_MIN_ROWS each
    for tokens in (3, many):
        x = torch.randn(tokens, 64).bfloat16()
        idx = torch.stack([torch.randperm(4)[:2] for _ in range(tokens)])
        w = torch.rand(tokens, 2).bfloat16()
        want = _loop_moe(experts.float(), x.float(), idx, w.float())
        experts.bfloat16()
        torch.testing.assert_close(fused(x, idx, w).float(), want, rtol=3e-2, atol=3e-2)
    assert packed_calls == ([3] if amx else [3, many])


def test_per_expert_groups_padded_with_zero_rows_give_the_same_product():
    """The AMX path runs each expert's group padded (to its row bucket): the pad rows are zeros
    whose outputs are dropped, so the product is the unpadded one, an idle expert included."""
    torch.manual_seed(3)
    experts = nn.ModuleList(_MLP(32, 16) for _ in range(5))
    fused = RoutedExperts.pack(experts)
    x = torch.randn(37, 32)
    idx = torch.stack([torch.randperm(4)[:2] for _ in range(37)])  # expert 4 idle
    w = torch.rand(37, 2)
    gate_ups = [lambda v, g=g: v @ g.T for g in fused.gate_up]
    downs = [lambda v, d=d: v @ d.T for d in fused.down]
    sizes = []

    def pad(c):
        sizes.append(c + 3)
        return c + 3

    want = fused._per_expert(x, idx, w, gate_ups, downs)
    got = fused._per_expert(x, idx, w, gate_ups, downs, pad=pad)
    assert len(sizes) == 4  # the idle expert gets no group
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(want, _loop_moe(experts, x, idx, w), atol=1e-5, rtol=1e-5)
