"""gpt-oss' experts kept MXFP4-packed (``gpt_oss_moe.PackedGptOssExperts``) equal transformers'
``GptOssExperts`` holding the dequantized weights (``quant.dequant_mxfp4``, transposed to its
``[E, in, out]``): biases, the interleaved gate / up columns, the clamped SwiGLU (both clamps
reached), the router's weights, an expert no token chose, odd token counts, on the AVX-512 build
and the AVX2 one.

Tolerance: the packed kernel widens the very dequantized weights (bit for bit, w_elem.h), so the
only difference is float32 summation order: ``|got - want| <= 1e-5 * max|want| + 1e-5 * |want|``.
bfloat16 activations: rounded on the way in and out, within 2% of the output's largest value."""

import pytest
import torch
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

from llm_svc.models import cpu_packed, qweight
from llm_svc.models.gpt_oss_moe import DOWN, GATE_UP, PackedGptOssExperts
from llm_svc.models.quant import dequant_mxfp4

pytestmark = pytest.mark.unit

BUILDS = {"native": cpu_packed.KERNELS, "avx2": cpu_packed.builds(("-mno-avx512f",), "_avx2")}
E, H, I, K = 5, 160, 96, 2
UNUSED = 3  # no token chooses this expert


def _stored(n: int, k: int, seed: int):
    """Random MXFP4 experts ``[E, n, k]``: (blocks, scales) as published and the dequantized float32."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (E, n, k // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(119, 125, (E, n, k // 32), generator=g, dtype=torch.uint8)
    return blocks, scales, dequant_mxfp4(blocks, scales)


@pytest.fixture(scope="module")
def experts():
    """(transformers' module on the dequantized weights, the stored tensors by name)."""
    gu, dn = _stored(2 * I, H, seed=1), _stored(H, I, seed=2)
    ref = GptOssExperts(GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        ref.gate_up_proj.copy_(gu[2].transpose(1, 2))  # [E, H, 2I]
        ref.down_proj.copy_(dn[2].transpose(1, 2))  # [E, I, H]
        ref.gate_up_proj_bias.copy_(torch.randn(E, 2 * I, generator=g))
        ref.down_proj_bias.copy_(torch.randn(E, H, generator=g))
    return ref, {GATE_UP: gu[:2], DOWN: dn[:2]}


def _packed(ref, stored, kernels=None) -> PackedGptOssExperts:
    m = PackedGptOssExperts.like(ref, torch.float32)
    with torch.no_grad():
        m.gate_up_proj_bias.copy_(ref.gate_up_proj_bias)
        m.down_proj_bias.copy_(ref.down_proj_bias)
    for name, (blocks, scales) in stored.items():
        m.set_packed(name, blocks, scales, kernels=kernels)
    return m


def _routing(tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g)
    chosen = torch.tensor([e for e in range(E) if e != UNUSED])
    idx = torch.stack([chosen[torch.randperm(E - 1, generator=g)[:K]] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, K, generator=g), -1)
    return x, idx, w


def _close(got, want, rel=1e-5):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=rel * float(want.abs().max()) + 1e-6)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("tokens", [1, 5, 13, 64])
def test_packed_experts_equal_transformers_on_dequantized_weights(experts, build, tokens):
    ref, stored = experts
    m = _packed(ref, stored, BUILDS[build])
    x, idx, w = _routing(tokens, seed=tokens)
    with torch.no_grad():
        want = ref(x, idx, w)
        gu = torch.einsum("th,ehn->etn", x, ref.gate_up_proj) + ref.gate_up_proj_bias[:, None]
    assert (gu[..., ::2] > ref.limit).any() and (gu[..., 1::2].abs() > ref.limit).any()  # both clamps bite
    assert (gu[..., ::2] < ref.limit).any()
    got = m(x, idx, w)
    assert got.dtype == torch.float32 and got.shape == (tokens, H)
    _close(got, want)


def test_bfloat16_activations(experts):
    ref, stored = experts
    m = _packed(ref, stored)
    x, idx, w = _routing(13, seed=7)
    with torch.no_grad():
        want = ref(x.bfloat16().float(), idx, w)
    got = m(x.bfloat16(), idx, w)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0, atol=0.02 * float(want.abs().max()))


def test_no_float_weights_and_state_dict_is_the_dequantized_module(experts):
    ref, stored = experts
    m = _packed(ref, stored)
    assert sorted(n for n, _ in m.named_parameters()) == ["down_proj_bias", "gate_up_proj_bias"]
    assert m.nbytes == E * (2 * I * H + H * I) * (1 / 2 + 1 / 32)
    assert all(p.fmt == "mxfp4" for ps in m.packed.values() for p in ps)
    got, want = m.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_wrong_shapes_and_expert_indices_are_refused(experts):
    ref, stored = experts
    m = _packed(ref, stored)
    blocks, scales = stored[DOWN]
    with pytest.raises(ValueError, match=r"has shape \[5, 160, 3, 16\], the config implies \[5, 192, 5, 16\]"):
        m.set_packed(GATE_UP, blocks, scales)
    x, idx, w = _routing(3, seed=1)
    with pytest.raises(ValueError, match=r"outside \[0, 5\)"):
        m(x, idx + E, w)


def test_packed_kernel_builds_for_mxfp4():
    assert qweight.kernel("mxfp4") is not None  # CI has a compiler: the packed path must be the one tested
