"""The hub's quantized / fused forms, served as published:

* MiMo ``fused_qkv``: the same model as the split form of the same weights (bitwise).
* MiMo block FP8: the same model as the float checkpoint whose weights are the FP8 values
  dequantized by this test's own element-wise reference (bitwise: fp32 products).
* gpt-oss MXFP4: transformers' ``GptOssForCausalLM`` with ``Mxfp4Config(dequantize=True)`` as
  the oracle (greedy tokens equal, logits within 2e-4), and the same model as the float
  checkpoint whose experts transformers' ``convert_moe_packed_tensors`` dequantized; served
  with its experts kept packed (the CPU default), the same greedy tokens through the engine as
  the dequantize-at-load path, with no float copy of the experts.
* wrong checkpoints fail at startup naming the file and the tensor / field.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llm_svc.loading.loader import load_lm
from llm_svc.types.request import PreparedRequest
from shared.bundle import CheckpointError
from shared.schemas import SamplingParams
from mmserve.tiny import mimo_published as mp
from mmserve.tiny.gpt_oss import write_gpt_oss
from tests.conftest import SMALL_W
from tests.integration.test_llm_engine import make_engine, run_to_end
from tests.unit.test_llm_runner import SlotSim, hf_logits, make_runner, run_chunked

pytestmark = pytest.mark.integration
PRESETS = {"mimo-v2.5": mp.V25, "mimo-v2-flash": mp.FLASH}


def _prompts(n=(5, 40, 100), seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 600, (k,), generator=g).tolist() for k in n]


def _greedy(lm, prompts, max_tokens=12):
    preps = [PreparedRequest(request_id=f"r{i}", prompt_ids=p, sampling=SamplingParams(max_tokens=max_tokens,
                                                                                       ignore_eos=True))
             for i, p in enumerate(prompts)]
    streams = run_to_end(make_engine(lm), preps)
    return [streams[f"r{i}"].tokens for i in range(len(prompts))]


def _assert_same_weights(a, b):
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    diff = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not diff, diff[:5]


def _dequantize_reference(src: Path, dst: Path, chunks: int) -> Path:
    """``src`` (FP8, maybe fused) as a float split checkpoint: every e4m3 weight times the scale of
    its block (each of ``chunks`` row chunks of a fused qkv_proj with its own scale rows), the
    fused rows split head by head."""
    cfg = json.loads((src / "config.json").read_text())
    block = cfg["quantization_config"]["weight_block_size"]
    state = load_file(str(src / "model.safetensors"))
    out = {}
    for name, t in state.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = state[name + "_scale_inv"]
            n = chunks if ".qkv_proj." in name else 1
            rows = t.shape[0] // n
            per = -(-rows // block[0])
            r = torch.arange(t.shape[0])
            srow = (r // rows) * per + (r % rows) // block[0]
            t = t.float() * s[srow][:, torch.arange(t.shape[1]) // block[1]]
        out[name] = t
    for name in [n for n in out if n.startswith(("model.layers.", "model.mtp.layers.")) and ".qkv_proj." in n]:
        mtp = name.startswith("model.mtp.")  # MTP layers are of the sliding kind
        sw = 1 if mtp else cfg["hybrid_layer_pattern"][int(name.split(".")[2])]
        heads = cfg["swa_num_attention_heads" if sw else "num_attention_heads"]
        kv = cfg["swa_num_key_value_heads" if sw else "num_key_value_heads"]
        dq, dv = cfg["swa_head_dim" if sw else "head_dim"], cfg["swa_v_head_dim" if sw else "v_head_dim"]
        t, parts, at = out.pop(name), {"q": [], "k": [], "v": []}, 0
        for c in range(chunks):
            for p, count, d in (("q", heads // chunks, dq), ("k", kv // chunks, dq), ("v", kv // chunks, dv)):
                for _ in range(count):
                    parts[p].append(t[at:at + d])
                    at += d
        for p, rows in parts.items():
            out[name.replace(".qkv_proj.", f".{p}_proj.")] = torch.cat(rows)
    shutil.copytree(src, dst)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    del cfg["quantization_config"]
    cfg["attention_projection_layout"] = "split"
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _assert_matches_transformers(ours, hf, label: str) -> None:
    """Logits within 2e-4 on a chunked prefill + greedy tokens equal on 3 prompts, ours vs ``hf``."""
    ids = _prompts((98,), seed=3)[0]
    ref = hf_logits(replace(ours, model=hf), ids)
    got = run_chunked(make_runner(ours), SlotSim(2048, 256, seed=7), "a", ids, 13, 90)
    worst = max(float((logits - ref[p]).abs().max()) for p, logits in got.items())
    prompts = _prompts()
    greedy = _greedy(ours, prompts)
    equal = 0
    for p, toks in zip(prompts, greedy, strict=True):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(p):]
        equal += toks == want.tolist()
    print(f"\n[transformers-oracle] {label}: greedy equal {equal}/{len(prompts)}, max |logit diff| "
          f"{worst:.2e}, {len({t for g in greedy for t in g})} distinct tokens", file=sys.stderr)
    assert worst < 2e-4, worst
    assert equal == len(prompts)
    assert len({t for g in greedy for t in g}) > 8


@pytest.mark.parametrize("arch", list(PRESETS))
def test_mimo_fused_qkv_is_the_split_model(arch, tmp_path):
    spec = PRESETS[arch]
    split = load_lm(str(mp.write_mimo_published(tmp_path / "split", spec, sliding_window=SMALL_W)))
    d = mp.write_mimo_published(tmp_path / "fused", spec, sliding_window=SMALL_W, layout="fused_qkv")
    names = load_file(str(d / "model.safetensors")).keys()
    assert any(n.endswith("self_attn.qkv_proj.weight") for n in names) and not any("q_proj" in n for n in names)
    fused = load_lm(str(d))
    _assert_same_weights(fused, split)
    prompts = _prompts()
    assert _greedy(fused, prompts) == _greedy(split, prompts)


@pytest.mark.parametrize("arch, layout", [("mimo-v2.5", "fused_qkv"), ("mimo-v2-flash", "split")])
def test_mimo_fp8_is_the_dequantized_float_model(arch, layout, tmp_path):
    spec = PRESETS[arch]
    d = mp.write_mimo_published(tmp_path / "fp8", spec, sliding_window=SMALL_W, layout=layout, quant="fp8")
    stored = load_file(str(d / "model.safetensors"))
    fp8 = [n for n, t in stored.items() if t.dtype == torch.float8_e4m3fn]
    assert len(fp8) > 20 and all(n + "_scale_inv" in stored for n in fp8)
    ref_dir = _dequantize_reference(d, tmp_path / "ref", spec.kv_heads if layout == "fused_qkv" else 1)
    got, ref = load_lm(str(d)), load_lm(str(ref_dir))
    _assert_same_weights(got, ref)
    ids = _prompts((60,), seed=3)[0]
    a = run_chunked(make_runner(got), SlotSim(2048, 256, seed=1), "a", ids, 16, 40)
    b = run_chunked(make_runner(ref), SlotSim(2048, 256, seed=1), "b", ids, 16, 40)
    assert all(torch.equal(a[p], b[p]) for p in a)
    # and it is a quantization of the float model, not another one
    float_lm = load_lm(str(mp.write_mimo_published(tmp_path / "f32", spec, sliding_window=SMALL_W)))
    w = "model.layers.1.mlp.experts.0.up_proj.weight"
    err = (got.model.state_dict()[w] - float_lm.model.state_dict()[w]).abs().max()
    assert 0 < float(err) < 0.07 * float(float_lm.model.state_dict()[w].abs().max())


def test_mimo_omni_with_a_fused_fp8_lm_serves_lm_and_towers(tmp_path):
    """MiMo-V2.5 omni as on the hub: the LM fused + FP8 in the same files as the bf16 towers."""
    from encoder_svc.models.loader import load_models
    from shared.bundle import load_bundle_spec
    from mmserve.tiny.mimo_omni import write_mimo_omni
    from mmserve.tiny.quantize import FP8_QUANT_CONFIG

    d = write_mimo_omni(tmp_path / "omni", 0, SMALL_W)
    state = load_file(str(d / "model.safetensors"))
    save_file(mp.quantize_fp8(mp.fuse_qkv(state, mp.V25), mp.V25), str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(quantization_config=dict(FP8_QUANT_CONFIG), attention_projection_layout="fused_qkv")
    (d / "config.json").write_text(json.dumps(cfg))
    got = load_lm(str(d))
    assert got.model.geometry.quant_method == "fp8"
    _assert_same_weights(got, load_lm(str(_dequantize_reference(d, tmp_path / "ref", mp.V25.kv_heads))))
    assert load_models(load_bundle_spec(d)) is not None  # the towers read past the LM's FP8 tensors


def test_mimo_flash_fp8_matches_transformers_fp8_dequantize(tmp_path):
    """transformers' own FP8 reader (``FineGrainedFP8Config(dequantize=True)``) on the same FP8
    tensors, its config rewritten in transformers' dialect (vLLM's CPU build has no FP8 kernel)."""
    from transformers import FineGrainedFP8Config, MiMoV2FlashForCausalLM

    d = mp.write_mimo_published(tmp_path / "fp8", mp.FLASH, sliding_window=SMALL_W, quant="fp8")
    hf_dir = mp.to_transformers_dialect(d, tmp_path / "fp8-hf")
    assert json.loads((hf_dir / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    ours = load_lm(str(d))
    hf = MiMoV2FlashForCausalLM.from_pretrained(str(hf_dir), quantization_config=FineGrainedFP8Config(dequantize=True),
                                               dtype=torch.float32, attn_implementation="eager").eval()
    _assert_matches_transformers(ours, hf, "mimo-v2-flash fp8")


@pytest.mark.parametrize("fixture", ["fp8_dir", "oss_mxfp4"])
def test_served_in_bfloat16_is_the_float32_load_rounded(fixture, request):
    d = request.getfixturevalue(fixture)
    f32, bf16 = load_lm(str(d)), load_lm(str(d), dtype="bfloat16")
    a, b = f32.model.state_dict(), bf16.model.state_dict()
    assert all(b[k].dtype == torch.bfloat16 and torch.equal(b[k], a[k].to(torch.bfloat16)) for k in a)


def _assert_edit_refused(src: Path, tmp_path: Path, edit: tuple, match: str) -> None:
    """A copy of ``src`` with one tensor replaced (or deleted: None) fails to load with ``match``."""
    d = shutil.copytree(src, tmp_path / "bad")
    name, value = edit
    state = load_file(str(d / "model.safetensors"))
    if value is None:
        del state[name]
    else:
        state[name] = value
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"bad/model.safetensors: .*" + match):
        load_lm(str(d))


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    return mp.write_mimo_published(tmp_path_factory.mktemp("fp8") / "v25", mp.V25, sliding_window=SMALL_W,
                                   layout="fused_qkv", quant="fp8")


@pytest.mark.parametrize("edit, match", [
    (("model.layers.1.self_attn.qkv_proj.weight_scale_inv", torch.ones(3, 1)),
     r"'model.layers.1.self_attn.qkv_proj.weight_scale_inv': scale has shape \[3, 1\]"),
    (("model.layers.0.mlp.up_proj.weight_scale_inv", None),
     r"tensor 'model.layers.0.mlp.up_proj.weight' is float8_e4m3fn but 'model.layers.0.mlp.up_proj.weight_scale_inv'"
     r" is missing"),
    (("model.layers.0.mlp.gate_proj.weight", None),
     r"tensor 'model.layers.0.mlp.gate_proj.weight_scale_inv' is a fp8 scale without its quantized tensor"),
    (("model.layers.2.self_attn.qkv_proj.weight", torch.zeros(200, 128).to(torch.float8_e4m3fn)),
     r"tensor 'model.layers.2.self_attn.qkv_proj.weight': fused qkv_proj has 200 rows, not 2 chunks of 64 Q"),
])
def test_bad_fp8_tensors_are_named(fp8_dir, tmp_path, edit, match):
    _assert_edit_refused(fp8_dir, tmp_path, edit, match)


def test_sharded_fp8_checkpoint_with_scales_in_another_shard(fp8_dir, tmp_path):
    """As on the hub: model.safetensors.index.json, a weight and its scale in different shards."""
    d = shutil.copytree(fp8_dir, tmp_path / "sharded")
    state = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    shards = {f: {n: t for n, t in state.items() if n.endswith("_scale_inv") == (f == "model-00002-of-00002.safetensors")}
              for f in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")}
    for f, part in shards.items():
        save_file(part, str(d / f), metadata={"format": "pt"})
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}))
    _assert_same_weights(load_lm(str(d)), load_lm(str(fp8_dir)))
    state = load_file(str(d / "model-00001-of-00002.safetensors"))
    del state["model.layers.4.mlp.experts.3.down_proj.weight"]
    save_file(state, str(d / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    index = json.loads((d / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.4.mlp.experts.3.down_proj.weight"]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"sharded/model-00002-of-00002.safetensors: tensor "
                                              r"'model.layers.4.mlp.experts.3.down_proj.weight_scale_inv' is a fp8 scale"):
        load_lm(str(d))


@pytest.mark.parametrize("change, match", [
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "store_dtype": "mxfp4"}},
     r"field 'quantization_config.store_dtype' is not understood"),
    ({"quantization_config": {"quant_method": "mxfp4"}},
     r"field 'quantization_config.quant_method' = 'mxfp4' is not supported for this model"),
    ({"swa_num_key_value_heads": 1}, r"field 'attention_projection_layout' = 'fused_qkv' is stored in "
                                     r"num_key_value_heads = 2 chunks, which do not divide the sliding layers' 4 heads / 1"),
    ({"attention_projection_layout": "split"}, r"qkv_proj.weight': is fused but attention_projection_layout is 'split'"),
])
def test_bad_quant_configs_are_named(fp8_dir, tmp_path, change, match):
    d = shutil.copytree(fp8_dir, tmp_path / "bad")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"bad/(config.json|model.safetensors): .*" + match):
        load_lm(str(d))


# --- gpt-oss MXFP4 --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def oss_mxfp4(tmp_path_factory):
    return write_gpt_oss(tmp_path_factory.mktemp("oss") / "mxfp4", sliding_window=SMALL_W, quant="mxfp4")


@pytest.fixture(scope="module")
def oss_pair(oss_mxfp4):
    """(ours, transformers' Mxfp4Config(dequantize=True) load in float32)."""
    from transformers import GptOssForCausalLM, Mxfp4Config

    ours = load_lm(str(oss_mxfp4))
    hf = GptOssForCausalLM.from_pretrained(str(oss_mxfp4), quantization_config=Mxfp4Config(dequantize=True),
                                           attn_implementation="eager").float().eval()
    return ours, hf


def test_gpt_oss_mxfp4_layout_as_published(oss_mxfp4):
    cfg = json.loads((oss_mxfp4 / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"
    state = load_file(str(oss_mxfp4 / "model.safetensors"))
    b, s = state["model.layers.0.mlp.experts.gate_up_proj_blocks"], state["model.layers.0.mlp.experts.gate_up_proj_scales"]
    assert (b.dtype, s.dtype) == (torch.uint8, torch.uint8)
    assert b.shape == (4, 2 * 128, 128 // 32, 16) and s.shape == (4, 2 * 128, 128 // 32)  # [E, out, in/32, 16]
    assert "model.layers.0.mlp.experts.gate_up_proj" not in state


def test_gpt_oss_mxfp4_matches_transformers_dequantize(oss_pair):
    ours, hf = oss_pair
    sh = hf.state_dict()
    for k, v in ours.model.state_dict().items():
        assert torch.equal(v, sh[k].float()), k  # MXFP4 values are exact in bf16 too
    _assert_matches_transformers(ours, hf, "gpt-oss mxfp4")


def test_gpt_oss_mxfp4_is_the_float_model_of_its_dequantized_experts(oss_mxfp4, oss_pair, tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    d = shutil.copytree(oss_mxfp4, tmp_path / "float")
    state = load_file(str(d / "model.safetensors"))
    for name in [n for n in state if n.endswith("_blocks")]:
        stem = name[: -len("_blocks")]
        state[stem] = convert_moe_packed_tensors(state.pop(name), state.pop(stem + "_scales"), dtype=torch.float32)
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    del cfg["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    _assert_same_weights(oss_pair[0], load_lm(str(d)))


def _expert_weights(lm) -> list:
    return [layer.mlp.experts for layer in lm.model.model.layers]


def test_gpt_oss_mxfp4_served_packed_is_the_dequantized_path(oss_mxfp4, oss_pair):
    """Served packed (the default on the CPU: ``gpt_oss_moe``), the greedy tokens through the
    engine are the dequantize-at-load path's (``keep_packed=False``: transformers' experts)."""
    from llm_svc.models.gpt_oss_moe import PackedGptOssExperts
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    packed, ref = oss_pair[0], load_lm(str(oss_mxfp4), keep_packed=False)
    assert all(type(m) is PackedGptOssExperts for m in _expert_weights(packed))
    assert all(type(m) is GptOssExperts for m in _expert_weights(ref))
    prompts = _prompts()
    got, want = _greedy(packed, prompts, max_tokens=16), _greedy(ref, prompts, max_tokens=16)
    print(f"\n[gpt-oss mxfp4] packed vs dequantized: greedy equal {sum(a == b for a, b in zip(got, want))}/"
          f"{len(prompts)}, {len({t for g in got for t in g})} distinct tokens", file=sys.stderr)
    assert got == want
    assert len({t for g in got for t in g}) > 8


def test_gpt_oss_mxfp4_loaded_packed_holds_no_float_experts(oss_mxfp4, oss_pair):
    """The packed model's experts are their MXFP4 bytes (1/2 + 1/32 byte a weight) and its float
    parameters are the dequantized model's less the expert weights (biases stay float)."""
    packed, ref = oss_pair[0], load_lm(str(oss_mxfp4), keep_packed=False)
    names = [n for n, _ in packed.model.named_parameters()]
    assert not [n for n in names if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert all(n.endswith("_bias") for n in names if ".experts." in n)
    floats = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    experts_f32 = sum(m.gate_up_proj.nbytes + m.down_proj.nbytes for m in _expert_weights(ref))
    experts_packed = sum(m.nbytes for m in _expert_weights(packed))
    assert floats(packed.model) == floats(ref.model) - experts_f32
    assert experts_packed * 4 == experts_f32 * (1 / 2 + 1 / 32)  # 4.25 bits a weight against 32
    print(f"\n[gpt-oss mxfp4] experts resident: packed {experts_packed} B, dequantized float32 {experts_f32} B "
          f"({experts_f32 / experts_packed:.2f}x)", file=sys.stderr)


@pytest.mark.parametrize("edit, match", [
    (("model.layers.3.mlp.experts.down_proj_scales", torch.zeros(4, 128, 3, dtype=torch.uint8)),
     r"'model.layers.3.mlp.experts.down_proj_blocks': blocks \[4, 128, 4, 16\] and scales \[4, 128, 3\]"),
    (("model.layers.1.mlp.experts.gate_up_proj_blocks", None),
     r"tensor 'model.layers.1.mlp.experts.gate_up_proj_scales' is a mxfp4 scale without its quantized tensor"),
    (("model.layers.0.self_attn.q_proj.weight_blocks", torch.zeros(128, 4, 16, dtype=torch.uint8)),
     r"tensor 'model.layers.0.self_attn.q_proj.weight_scales' is missing"),
])
def test_bad_mxfp4_tensors_are_named(oss_mxfp4, tmp_path, edit, match):
    _assert_edit_refused(oss_mxfp4, tmp_path, edit, match)


def test_tiny_model_cli_writes_the_published_variants(tmp_path, capsys):
    from mmserve.cli import main

    assert main(["tiny-model", "--out", str(tmp_path / "m"), "--arch", "mimo-v2.5", "--layout", "fused_qkv",
                 "--quant", "fp8", "--sliding-window", str(SMALL_W)]) == 0
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["attention_projection_layout"] == "fused_qkv" and cfg["quantization_config"]["quant_method"] == "fp8"
    assert load_lm(str(tmp_path / "m")).model.geometry.quant_method == "fp8"
    assert main(["tiny-model", "--out", str(tmp_path / "g"), "--arch", "gemma3", "--quant", "mxfp4"]) == 2
    assert "--arch gemma3 has no --quant mxfp4" in capsys.readouterr().err
    assert not (tmp_path / "g").exists()
