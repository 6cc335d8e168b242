"""Published FP8 checkpoints served with their weights kept packed (``qweight``: FP8 bytes +
block scales, never widened as a whole) give the same greedy tokens as the same checkpoint
dequantized at load, and the module holds no float copy of the packed linears.

The logits differ only by float32 summation order (the packed kernel widens each FP8 tile row
with its scale to the very float32 weight the dequantize path holds: ``qweight.dense``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llm_svc.loading.loader import load_lm
from llm_svc.models import qweight
from mmserve.tiny import mimo_published as mp
from tests.conftest import SMALL_W
from tests.integration.test_quantized_checkpoints import PRESETS, _greedy, _prompts
from tests.unit.test_llm_runner import SlotSim, make_runner, run_chunked

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("arch, layout", [("mimo-v2.5", "fused_qkv"), ("mimo-v2-flash", "split")])
def test_mimo_fp8_served_packed_is_the_dequantized_model(arch, layout, tmp_path):
    d = mp.write_mimo_published(tmp_path / "fp8", PRESETS[arch], sliding_window=SMALL_W, layout=layout, quant="fp8")
    packed, ref = load_lm(str(d)), load_lm(str(d), keep_packed=False)
    linears = [(n, m) for n, m in packed.model.named_modules() if type(m) is nn.Linear]
    kept = {n: m for n, m in linears if getattr(m, "qweight", None) is not None}
    assert len(kept) > 20 and all(m.weight is None and m.qweight.fmt == "fp8" for m in kept.values())
    assert all(".experts." in n or ".self_attn." in n or ".mlp." in n for n in kept)  # not embeddings / lm_head
    ref_sd = ref.model.state_dict()
    for n, m in kept.items():  # the packed weight is the dequantized one, bit for bit
        assert torch.equal(qweight.dense(m.qweight), ref_sd[n + ".weight"]), n
    prompts = _prompts()
    assert _greedy(packed, prompts) == _greedy(ref, prompts)
    moe = [layer.mlp.experts for layer in packed.model.model.layers if hasattr(layer.mlp, "experts")]
    assert moe and all(e.packed_experts.fmt == "fp8" for e in moe)  # the engine ran them packed
    ids = _prompts((60,), seed=3)[0]
    a = run_chunked(make_runner(packed), SlotSim(2048, 256, seed=1), "a", ids, 16, 40)
    b = run_chunked(make_runner(ref), SlotSim(2048, 256, seed=1), "b", ids, 16, 40)
    assert max(float((a[p] - b[p]).abs().max()) for p in a) < 1e-3


def test_packed_load_keeps_no_float_copy_of_the_quantized_linears(tmp_path):
    d = mp.write_mimo_published(tmp_path / "fp8", PRESETS["mimo-v2-flash"], sliding_window=SMALL_W, quant="fp8")
    lm = load_lm(str(d))
    params = sum(p.numel() for p in lm.model.parameters())
    ref = sum(p.numel() for p in load_lm(str(d), keep_packed=False).model.parameters())
    packed = sum(m.qweight.n * m.qweight.k for m in lm.model.modules() if getattr(m, "qweight", None) is not None)
    assert params + packed == ref


def test_a_packed_models_state_dict_is_the_dequantized_ones(tmp_path):
    """``state_dict`` of linears kept packed gives their dequantized weights, before and after the
    engine's model joins q | k | v and gate | up and stacks the experts."""
    from llm_svc.models.mimo import MiMoModel

    d = mp.write_mimo_published(tmp_path / "fp8", PRESETS["mimo-v2.5"], sliding_window=SMALL_W, layout="fused_qkv",
                                quant="fp8")
    packed, ref = load_lm(str(d)), load_lm(str(d), keep_packed=False)
    want = ref.model.state_dict()
    for when in ("loaded", "served"):
        got = packed.model.state_dict()
        assert got.keys() == want.keys(), when
        assert not [k for k in want if not torch.equal(got[k], want[k])], when
        MiMoModel(packed.model)


@pytest.mark.parametrize("quant", ["fp8", None])
def test_bfloat16_serves_through_the_packed_kernels(quant, tmp_path):
    """``--dtype bfloat16``: FP8 linears stay packed (bfloat16 activations widened at the kernel
    boundary) and a float checkpoint's linears and experts run the kernel's bfloat16 build."""
    from llm_svc.models.fused_mlp import RoutedExperts
    from llm_svc.models.linear import AmxSplitLinear, PackedLinear, amx_bf16

    def packed_of(fwd):
        """The packed kernel's linear; on a CPU with AMX a bfloat16 tensor's is inside its split."""
        if isinstance(fwd, AmxSplitLinear):
            assert amx_bf16() and fwd.weight.dtype == torch.bfloat16
            return fwd.small
        return fwd

    d = mp.write_mimo_published(tmp_path / "m", PRESETS["mimo-v2-flash"], sliding_window=SMALL_W, quant=quant)
    lm = load_lm(str(d), dtype="bfloat16")
    prompts = _prompts()
    got = _greedy(lm, prompts)
    assert all(len(t) == 12 for t in got)
    fmt = "fp8" if quant else "bfloat16"
    assert packed_of(lm.model.lm_head.forward).weight.fmt == "bfloat16"
    moe = lm.model.model.layers[1].mlp.experts
    if quant:
        assert moe.packed_experts.fmt == "fp8"
    else:
        assert RoutedExperts.pack(moe).packed.fmt == fmt
    assert isinstance(packed_of(lm.model.model.layers[0].self_attn.o_proj.forward), PackedLinear)
    want = _greedy(load_lm(str(d)), prompts)  # float32 on the same weights
    assert any(g[0] == w[0] for g, w in zip(got, want))  # a random tiny model: bfloat16 soon diverges


def test_without_the_fp8_kernel_the_checkpoint_is_dequantized_at_load(tmp_path, monkeypatch):
    """Where the FP8 build cannot be built (no compiler) the same checkpoint loads dequantized,
    as before, and serves."""
    from llm_svc.models import qweight as q

    d = mp.write_mimo_published(tmp_path / "fp8", PRESETS["mimo-v2-flash"], sliding_window=SMALL_W, quant="fp8")
    real = q.kernel
    monkeypatch.setattr(q, "kernel", lambda fmt, kernels=None: None if fmt == "fp8" else real(fmt, kernels))
    lm = load_lm(str(d))
    assert not [m for m in lm.model.modules() if getattr(m, "qweight", None) is not None]
    assert lm.model.model.layers[1].mlp.experts[0].up_proj.weight.dtype == torch.float32
    assert all(len(t) == 12 for t in _greedy(lm, _prompts()))


def test_the_module_tree_stays_callable_before_and_after_the_engine_packs_it(tmp_path):
    """A linear kept packed is still a module one can call (its own forward, e.g. the tree's MoE
    module), with the dequantized model's result, before and after the engine's model joins and
    stacks its weights."""
    from llm_svc.models.mimo import MiMoModel

    d = mp.write_mimo_published(tmp_path / "fp8", PRESETS["mimo-v2.5"], sliding_window=SMALL_W, layout="fused_qkv",
                                quant="fp8")
    packed, ref = load_lm(str(d)), load_lm(str(d), keep_packed=False)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    for when in ("loaded", "served"):
        for name in ("layers.0.self_attn.q_proj", "layers.0.mlp", "layers.1.mlp"):
            got = packed.model.model.get_submodule(name)(x)
            want = ref.model.model.get_submodule(name)(x)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{when} {name}")
        MiMoModel(packed.model)
