"""shared/: wire format, hashing, settings, bundle reading, projector, compose interpolation."""

from __future__ import annotations

import json

import pytest
import torch

from gateway.openai_api.requests import ChatCompletionRequest
from shared.bundle import BundleError, load_bundle_spec
from mmserve.compose_local import interpolate
from shared.hashing import HASH_NAME, content_hash, hash_to_int
from shared.projector import PoolProjector, ProjectorConfig
from shared.schemas import EncodeResult, GenerateRequest, PromptMedia, PromptMessage, PromptText
from shared.settings import GatewaySettings
from shared.wire import WireError, pack, unpack

pytestmark = pytest.mark.unit


def test_wire_roundtrip_keeps_tensors_and_header():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    hdr = EncodeResult(modality="image", content_hash="ab" * 16, model="m", num_tokens=3, hidden_size=4)
    tensors, back = unpack(pack({"embeds": t}, hdr), EncodeResult)
    assert torch.equal(tensors["embeds"], t)
    assert back == hdr


def test_wire_rejects_garbage_and_wrong_header_type():
    with pytest.raises(WireError):
        unpack(b"not safetensors at all", EncodeResult)
    hdr = EncodeResult(modality="image", content_hash="0" * 32, model="m", num_tokens=1, hidden_size=1)
    with pytest.raises(WireError, match="expected header GenerateRequest"):
        unpack(pack({"x": torch.zeros(1)}, hdr), GenerateRequest)


def test_content_hash_is_stable_and_content_sensitive():
    assert HASH_NAME == "sha256"
    a, b = content_hash(b"abc"), content_hash(b"abd")
    assert a == content_hash(bytearray(b"abc")) and len(a) == 64 and a != b
    assert a == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"  # FIPS 180-2 "abc"
    assert 0 <= hash_to_int(a) < 2**64


def test_generate_request_requires_dense_media_indices():
    def media(i):
        return PromptMedia(modality="image", index=i, content_hash="0" * 32, num_tokens=4)

    ok = GenerateRequest(request_id="r", messages=[PromptMessage(role="user", content=[PromptText(text="hi"), media(1), media(0)])])
    assert [m.index for m in ok.media()] == [0, 1]
    with pytest.raises(ValueError, match="without gaps"):
        GenerateRequest(request_id="r", messages=[PromptMessage(role="user", content=[media(1)])])


def test_chat_request_rejects_unknown_part_type_and_normalizes_stop():
    with pytest.raises(ValueError):
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "hologram"}]}]}
        )
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": "END"})
    assert req.stop == ["END"] and req.effective_max_tokens(9) == 9


def test_gateway_settings_read_comma_separated_env(monkeypatch):
    monkeypatch.setenv("MMSERVE_GATEWAY_ENCODER_URLS", "http://a:1, http://b:2")
    monkeypatch.setenv("MMSERVE_GATEWAY_API_KEYS", '["k1","k2"]')
    s = GatewaySettings()
    assert s.encoder_urls == ["http://a:1", "http://b:2"] and s.api_keys == ["k1", "k2"]


def test_bundle_specs_of_both_layouts(mimo_bundle, gemma3_bundle, tmp_path):
    m = load_bundle_spec(mimo_bundle)
    assert m.lm_architecture == "MiMoV2FlashForCausalLM"
    assert m.modalities() == ["audio", "image", "video"] and m.vision.tokens_per_image == 16
    g = load_bundle_spec(gemma3_bundle)
    assert g.lm_architecture == "Gemma3ForConditionalGeneration" and g.vision.kind == "gemma3"
    cfg = json.loads((gemma3_bundle / "config.json").read_text())
    assert g.placeholders["image"].pad == "<image_soft_token>"
    assert cfg["image_token_index"] != cfg["boi_token_index"]
    with pytest.raises(BundleError, match="does not exist"):
        load_bundle_spec(tmp_path / "missing")
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(BundleError, match="not valid JSON"):
        load_bundle_spec(tmp_path)


def test_tiny_mimo_keeps_the_hybrid_pattern(mimo_bundle):
    cfg = json.loads((mimo_bundle / "config.json").read_text())
    types = cfg["layer_types"]
    assert types.count("full_attention") == 1 and types.count("sliding_attention") == 6
    assert cfg["sliding_window"] == 128 and cfg["head_dim"] != cfg["v_head_dim"]
    assert cfg["n_routed_experts"] > cfg["num_experts_per_tok"] >= 1


def test_projector_pools_and_roundtrips(tmp_path):
    torch.manual_seed(0)
    p = PoolProjector(ProjectorConfig(8, 6, "grid2d", tokens=4)).eval()
    x = torch.randn(2, 16, 8)
    y = p(x)
    assert y.shape == (2, 4, 6)
    # grid pooling: token 0 is the mean of the top-left 2x2 patches
    grid = x.reshape(2, 4, 4, 8)
    pooled0 = grid[:, :2, :2].mean(dim=(1, 2))
    assert torch.allclose(p.pool(x)[:, 0], pooled0, atol=1e-6)
    p.save(tmp_path)
    assert torch.allclose(PoolProjector.load(tmp_path)(x), y)
    a = PoolProjector(ProjectorConfig(8, 6, "seq1d", stride=3))
    assert a.pool(torch.randn(1, 10, 8)).shape == (1, 4, 8)
    with pytest.raises(ValueError, match="square"):
        ProjectorConfig(8, 6, "grid2d", tokens=5)


def test_compose_interpolation():
    env = {"A": "x", "EMPTY": ""}
    assert interpolate("${A:-d}/${B:-def}/${EMPTY:-e}/${A}", env) == "x/def/e/x"
