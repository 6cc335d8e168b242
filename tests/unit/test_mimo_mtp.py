"""MiMo's MTP layers as published: loaded from ``model.mtp.layers.M.*`` and equal to a plain
re-implementation read straight from the file; the dense LM forward equal to transformers';
checkpoints whose MTP tensors are missing, extra or misshaped refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from llm_svc.loading.loader import load_lm
from llm_svc.models import mimo_mtp
from llm_svc.models.mimo_reference import lm_hidden
from shared.bundle import CheckpointError
from mmserve.tiny import mimo_published as mp
from tests.conftest import SMALL_W

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    d = mp.write_mimo_published(tmp_path_factory.mktemp("mtp") / "flash", mp.FLASH, sliding_window=SMALL_W)
    return d, load_lm(str(d)).model


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta, r):
    """x [T, H, D]: rotate the first r dims by pairs (i, i + r/2)."""
    inv = 1.0 / theta ** (torch.arange(0, r, 2).float() / r)
    ang = pos[:, None].float() * inv[None]  # [T, r/2]
    c, s = ang.cos()[:, None], ang.sin()[:, None]
    a, b = x[..., : r // 2], x[..., r // 2: r]
    return torch.cat([a * c - b * s, b * c + a * s, x[..., r:]], dim=-1)


def plain_mtp_layer(t: dict, p: str, cfg: dict, hidden, embeds, pos):
    """One MTP layer written out from the checkpoint's tensors and config.json alone."""
    eps, w = cfg["layernorm_epsilon"], lambda n: t[p + n].float()
    heads, kv, d, dv = (cfg["swa_num_attention_heads"], cfg["swa_num_key_value_heads"], cfg["swa_head_dim"],
                        cfg["swa_v_head_dim"])
    r, window = int(d * cfg["partial_rotary_factor"]), cfg["sliding_window_size"]
    x = torch.cat([_rms(embeds, w("enorm.weight"), eps), _rms(hidden, w("hnorm.weight"), eps)], -1) @ w("eh_proj.weight").T
    a = _rms(x, w("input_layernorm.weight"), eps)
    n = a.shape[0]
    q = _rope((a @ w("self_attn.q_proj.weight").T).view(n, heads, d), pos, cfg["swa_rope_theta"], r)
    k = _rope((a @ w("self_attn.k_proj.weight").T).view(n, kv, d), pos, cfg["swa_rope_theta"], r)
    v = (a @ w("self_attn.v_proj.weight").T).view(n, kv, dv) * cfg["attention_value_scale"]
    sinks = w("self_attn.attention_sink_bias")
    out = torch.zeros(n, heads, dv)
    for i in range(n):
        for h in range(heads):
            keys = [j for j in range(n) if i - window < j <= i]
            s = torch.stack([q[i, h] @ k[j, h * kv // heads] for j in keys]) * d ** -0.5
            p_ = torch.softmax(torch.cat([s, sinks[h:h + 1]]), 0)[:-1]
            out[i, h] = sum(pj * v[j, h * kv // heads] for pj, j in zip(p_, keys))
    x = x + out.reshape(n, -1) @ w("self_attn.o_proj.weight").T
    m = _rms(x, w("pre_mlp_layernorm.weight"), eps)
    x = x + (F.silu(m @ w("mlp.gate_proj.weight").T) * (m @ w("mlp.up_proj.weight").T)) @ w("mlp.down_proj.weight").T
    return _rms(x, w("final_layernorm.weight"), eps)


def test_loaded_mtp_layers_are_the_published_ones(flash):
    d, model = flash
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == len(model.mtp) == 3
    t = load_file(str(d / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    n = 2 * SMALL_W + 5  # several windows: the sliding mask matters
    hidden, embeds = torch.randn(n, mp.FLASH.hidden, generator=g), torch.randn(n, mp.FLASH.hidden, generator=g)
    pos = torch.arange(7, 7 + n)
    for m, layer in enumerate(model.mtp):
        with torch.no_grad():
            got = layer(hidden, embeds, pos)
        want = plain_mtp_layer(t, f"model.mtp.layers.{m}.", cfg, hidden, embeds, pos)
        assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), (m, float((got - want).abs().max()))


def test_chain_feeds_each_layer_the_previous_output_and_the_next_token(flash):
    _, model = flash
    ids = torch.randint(10, 600, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        h = lm_hidden(model, ids)
        outs = mimo_mtp.chain(model.mtp, model.model.embed_tokens, h, ids)
        assert [o.shape[-2] for o in outs] == [39, 38, 37]
        emb = model.model.embed_tokens
        one = model.mtp[2](outs[1][0, :37], emb(ids[0, 3:40]), torch.arange(37))
    assert torch.allclose(outs[2][0], one, atol=1e-6)


def test_dense_lm_forward_matches_transformers(flash, tmp_path):
    d, model = flash
    hf = load_lm(str(mp.to_transformers_dialect(d, tmp_path / "hf"))).model
    ids = torch.randint(10, 600, (1, 3 * SMALL_W), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = model.lm_head(lm_hidden(model, ids))
        ref = hf(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert float((ours - ref).abs().max()) < 2e-4


@pytest.mark.parametrize("layout,quant", [("fused_qkv", None), ("split", "fp8"), ("fused_qkv", "fp8")])
def test_published_forms_load_the_same_mtp_layers(flash, tmp_path, layout, quant):
    _, split = flash
    other = load_lm(str(mp.write_mimo_published(tmp_path / "x", mp.FLASH, sliding_window=SMALL_W,
                                                layout=layout, quant=quant))).model
    tol = 0.07 if quant else 0.0  # e4m3 keeps 3 mantissa bits
    for a, b in zip(split.mtp, other.mtp, strict=True):
        for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
            assert float((x - y).abs().max()) <= tol * float(x.abs().max()), name


def _edit(src, dst, drop=(), change=None, cfg=None):
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    for k in [k for k in state if k.startswith(drop)] if drop else ():
        del state[k]
    state.update(change or {})
    save_file(state, str(dst / "model.safetensors"))
    if cfg:
        c = json.loads((dst / "config.json").read_text())
        c.update(cfg)
        (dst / "config.json").write_text(json.dumps(c))
    return dst


def test_a_missing_mtp_layer_is_refused(flash, tmp_path):
    d = _edit(flash[0], tmp_path / "x", drop=("model.mtp.layers.2.",))
    with pytest.raises(CheckpointError, match=r"x/model.safetensors: config.json has num_nextn_predict_layers = 3, "
                                              r"but the checkpoint has no tensors of MTP layer 2"):
        load_lm(str(d))


def test_an_mtp_layer_the_config_does_not_declare_is_refused(flash, tmp_path):
    d = _edit(flash[0], tmp_path / "x", cfg={"num_nextn_predict_layers": 2})
    with pytest.raises(CheckpointError, match=r"tensor 'model.mtp.layers.2.eh_proj.weight' is MTP layer 2, but "
                                              r"config.json has num_nextn_predict_layers = 2"):
        load_lm(str(d))


def test_a_missing_mtp_tensor_is_named(flash, tmp_path):
    d = _edit(flash[0], tmp_path / "x", drop=("model.mtp.layers.1.pre_mlp_layernorm.",))
    with pytest.raises(CheckpointError, match=r"tensor 'model.mtp.layers.1.pre_mlp_layernorm.weight' is missing"):
        load_lm(str(d))


def test_a_misshaped_mtp_tensor_is_named(flash, tmp_path):
    d = _edit(flash[0], tmp_path / "x", change={"model.mtp.layers.0.eh_proj.weight": torch.zeros(128, 128)})
    with pytest.raises(CheckpointError, match=r"tensor 'model.mtp.layers.0.eh_proj.weight' has shape \[128, 128\], "
                                              r"the config implies \[128, 256\]"):
        load_lm(str(d))
