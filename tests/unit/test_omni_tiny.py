"""The tiny published-format writers: tensors by name/shape without mmserve's model code, and the
MiMo-V2.5 omni directory in the published layout (config keys, tensor names, tokens)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from encoder_svc.models.mimo_vit import MiMoViT, MiMoViTConfig
from llm_svc.models.geometry import mimo_geometry
from llm_svc.models.mimo_native import MiMoForCausalLM
from shared.bundle import load_bundle_spec
from mmserve.tiny import mimo_published as mp
from mmserve.tiny.mimo_omni import OMNI_SPECIALS, write_mimo_omni

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory) -> Path:
    return write_mimo_omni(tmp_path_factory.mktemp("omni") / "m")


@pytest.mark.parametrize("spec", [mp.FLASH, mp.V25], ids=["flash", "v25"])
def test_published_shapes_are_our_modules_state(spec):
    cfg = mp.published_config(spec, 640, 2, 0)
    ours = {k: tuple(v.shape) for k, v in MiMoForCausalLM(mimo_geometry(cfg), None).state_dict().items()}
    assert mp.published_shapes(spec, 640) == ours


def test_writers_do_not_import_llm_svc(tmp_path):
    code = ("import sys; from mmserve.tiny.mimo_omni import write_mimo_omni; "
            f"write_mimo_omni(__import__('pathlib').Path({str(tmp_path / 'm')!r})); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('llm_svc', 'encoder_svc', 'gateway')); "
            "assert not bad, bad")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


def test_omni_directory_layout(omni_dir):
    cfg = json.loads((omni_dir / "config.json").read_text())
    assert cfg["architectures"] == ["MiMoV2OmniForCausalLM"] and cfg["model_type"] == "mimo_v2"
    assert "hybrid_layer_pattern" in cfg and "swa_num_key_value_heads" in cfg  # the published LM dialect
    pc = cfg["processor_config"]
    assert pc["rope_type"] == "rope" and pc["use_video_timestamps"] is True
    tok = json.loads((omni_dir / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert set(OMNI_SPECIALS) <= set(added)
    for key, token in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                       ("vision_start_token_id", "<|vision_start|>"), ("video_start_token_id", "<|mimo_video_start|>"),
                       ("video_end_token_id", "<|mimo_video_end|>")):
        assert pc[key] == added[token], key
    with safe_open(str(omni_dir / "model.safetensors"), framework="pt") as f:
        visual = {k.removeprefix("visual."): tuple(f.get_slice(k).get_shape()) for k in f.keys() if k.startswith("visual.")}
    vit = MiMoViT(MiMoViTConfig.from_config(cfg, omni_dir / "config.json"))
    assert visual == {k: tuple(v.shape) for k, v in vit.state_dict().items()}
    assert any(k.endswith("attn.sinks") for k in visual) and "blocks.0.attn.sinks" not in visual  # full block: none
    assert json.loads((omni_dir / "preprocessor_config.json").read_text())["image_processor_type"] == "Qwen2VLImageProcessor"


def test_omni_bundle_spec(omni_dir):
    spec = load_bundle_spec(omni_dir)
    assert spec.vision.kind == "mimo_omni" and spec.vision.tokens_per_image == 0
    assert spec.placeholders["image"].pad == "<|image_pad|>" and spec.placeholders["image"].layout == "pad"
    v = spec.placeholders["video"]
    assert (v.layout, v.outer_start, v.outer_end, v.start) == (
        "timestamps", "<|mimo_video_start|>", "<|mimo_video_end|>", "<|vision_start|>")
    assert spec.audio is not None and (spec.audio.kind, spec.audio.path) == ("mimo_omni", ".")  # the audio part
    a = spec.placeholders["audio"]
    assert (a.start, a.pad, a.end) == ("<|mimo_audio_start|>", "<|audio_pad|>", "<|mimo_audio_end|>")


def test_omni_spec_refuses_a_token_id_the_tokenizer_lacks(omni_dir, tmp_path):
    import shutil

    from shared.bundle import CheckpointError

    d = Path(shutil.copytree(omni_dir, tmp_path / "bad"))
    cfg = json.loads((d / "config.json").read_text())
    cfg["processor_config"]["video_start_token_id"] = 99999
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"bad/config.json: field 'processor_config.video_start_token_id'"):
        load_bundle_spec(d)


def test_writer_is_deterministic(tmp_path):
    a, b = write_mimo_omni(tmp_path / "a", seed=3), write_mimo_omni(tmp_path / "b", seed=3)
    with safe_open(str(a / "model.safetensors"), framework="pt") as fa, \
         safe_open(str(b / "model.safetensors"), framework="pt") as fb:
        for k in ("visual.blocks.1.attn.sinks", "model.layers.1.self_attn.q_proj.weight"):
            assert torch.equal(fa.get_tensor(k), fb.get_tensor(k))
