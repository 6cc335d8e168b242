"""MiMo-V2.5 omni audio tower: configs as published, strict loading, the mel front-end vs
torchaudio, and the invariants an oracle cannot show (batch independence, segmenting, ranges).
The vLLM oracle is ``tests/integration/test_vllm_omni_audio.py``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from encoder_svc.models.mimo_audio import BUCKET_FRAMES, attention_mask
from encoder_svc.models.mimo_audio_weights import load_mimo_audio
from encoder_svc.preprocess.mimo_mel import log_mel, mel_magnitude
from shared.bundle import CheckpointError
from mmserve.testing.audio import SR, chirp
from mmserve.tiny.mimo_omni_audio import write_audio_only

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_audio_only(tmp_path_factory.mktemp("omni-audio") / "ckpt", lm_hidden=64, seed=0)


@pytest.fixture(scope="module")
def tower(tiny):
    t = load_mimo_audio(tiny, torch.float32, 64)
    t.check_integrity()
    yield t
    t.check_integrity()


def encode(tower, wave: torch.Tensor) -> torch.Tensor:
    items = tower.prepare(wave)
    return items.kept([tower(g) for g in items.groups])


def one(items) -> torch.Tensor:
    """The single batch group of a clip shorter than a segment."""
    assert len(items.groups) == 1 and len(items.groups[0]) == 1
    return items.groups[0]


def vllm_token_len(mel_frames: int, kernel=3, stride=2, pooler=2, group=4) -> int:
    """``MiMoVLProcessor.preprocess_audio``'s placeholder count (vLLM 0.32), on the whole mel."""
    n = mel_frames + 3 - kernel
    n = (n + 2 - kernel) // stride + 1
    n = n // pooler + int(n % pooler != 0)
    return math.ceil(n / group)


def test_mel_matches_torchaudio_transform():
    from torchaudio.transforms import MelSpectrogram

    wave = chirp(1.3)
    ref = MelSpectrogram(sample_rate=SR, n_fft=960, hop_length=240, win_length=960, f_min=0.0, f_max=None,
                         n_mels=128, power=1.0, center=True)(wave[None])[0]
    ours = mel_magnitude(wave, sr=SR, n_fft=960, win_length=960, hop=240, n_mels=128)
    assert ours.shape == ref.shape == (128, 1 + wave.numel() // 240)
    assert torch.allclose(ours, ref, rtol=1e-4, atol=1e-5)
    lm = log_mel(wave, sr=SR, n_fft=960, win_length=960, hop=240, n_mels=128)
    assert torch.allclose(lm, torch.log(torch.clip(ref, min=1e-7)), atol=1e-4)


@pytest.mark.parametrize("seconds", [0.05, 0.75, 1.0, 2.0, 7.99, 8.0, 8.01, 20.0, 65.3])
def test_token_count_is_the_processors(tower, seconds):
    wave = torch.zeros(int(SR * seconds))
    items = tower.prepare(wave)
    frames = 1 + wave.numel() // 240
    assert sum(items.tokens) == vllm_token_len(frames)
    seg = tower.enc_cfg.audio_segment_size
    assert len(items.tokens) == math.ceil(frames / seg)
    full, tail = frames // seg, frames % seg
    shapes = [tuple(g.shape) for g in items.groups]
    want = ([(full, 129, seg)] if full else []) + (
        [(1, 129, min(seg, math.ceil(tail / BUCKET_FRAMES) * BUCKET_FRAMES))] if tail else [])
    assert shapes == want  # full segments together, the tail alone in a 5 s bucket
    # the validity rows count each segment's frames
    assert sum((g[:, -1] > 0.5).sum().item() for g in items.groups) == frames


def test_shapes_codes_range_and_determinism(tower):
    x = one(tower.prepare(chirp(2.0)))
    codes, n = tower.codes(x)
    assert codes.shape == (1, 125, 8) and n.tolist() == [51]  # 201 mel -> 101 conv -> 51 codes
    valid = codes[0, :51]
    for c, size in enumerate(tower.tok_cfg.codebook_sizes):
        assert 0 <= valid[:, c].min() and valid[:, c].max() < size
    assert valid[:, 0].unique().numel() > 4  # the tiny init gives varied codes, a test that can fail
    out = tower(x)
    assert out.shape == (1, 32, 64) and torch.isfinite(out).all()
    assert torch.equal(out, tower(x))


def test_batch_neighbours_and_padding_do_not_change_an_item(tower):
    """Odd and even lengths (the last conv and pool frames are the delicate ones), alone vs
    batched with a longer item vs padded wider: the kept rows are identical."""
    waves = [chirp(s, seed=i) for i, s in enumerate((0.51, 1.0, 3.37))]
    alone = [encode(tower, w) for w in waves]
    items = [tower.prepare(w) for w in waves]
    width = max(one(it).shape[-1] for it in items)
    x = torch.zeros(len(items), one(items[0]).shape[1], width)
    for k, it in enumerate(items):
        x[k, :, : one(it).shape[-1]] = one(it)[0]
    out = tower(x)
    for k, it in enumerate(items):
        assert torch.allclose(out[k, : it.tokens[0]], alone[k], atol=1e-5), k


def test_segments_are_encoded_independently(tower):
    """A 20 s clip = three 8 s segments: its codes are each segment's codes, computed alone."""
    wave = chirp(20.0)
    items = tower.prepare(wave)
    x = torch.cat([torch.nn.functional.pad(g, (0, 800 - g.shape[-1])) for g in items.groups])  # [3, 129, 800]
    assert [int(v) for v in (x[:, -1] > 0.5).sum(-1)] == [800, 800, 401]
    assert [g.shape[-1] for g in items.groups] == [800, 500]  # the tail in its own 5 s bucket
    codes, n = tower.codes(x)
    for k in range(3):
        lone = torch.zeros(1, x.shape[1], 1000)
        m = int((x[k, -1] > 0.5).sum())
        lone[0, :, :m] = x[k, :, :m]
        c1, n1 = tower.codes(lone)
        assert int(n1) == int(n[k]) and torch.equal(c1[0, : n1[0]], codes[k, : n[k]])
    whole = encode(tower, wave)
    assert whole.shape == (vllm_token_len(2001), 64)


def test_attention_mask_is_flash_attn_semantics():
    n = torch.tensor([5, 3])
    for window, causal in (((2, 0), True), ((2, 0), False), ((-1, -1), True), ((-1, -1), False), ((1, 1), False)):
        m = attention_mask(n, 6, window, causal)  # [2, 1, 6, 6]
        for b in range(2):
            for i in range(6):
                for j in range(6):
                    right = 0 if causal else window[1]
                    want = j < n[b] and (window[0] < 0 or j >= i - window[0]) and (right < 0 or j <= i + right)
                    if i < n[b]:
                        assert bool(m[b, 0, i, j]) == want, (window, causal, b, i, j)
                assert m[b, 0, i].any(), "every row attends somewhere (a padded row: at least itself)"


def test_bfloat16_tower_keeps_float32_codebooks(tiny):
    t = load_mimo_audio(tiny, torch.bfloat16, 64)
    t.check_integrity()
    assert t.tokenizer.conv1.weight.dtype == torch.bfloat16
    assert all(b.embed.dtype == torch.float32 for b in t.tokenizer.codebooks)
    out = t(one(t.prepare(chirp(1.0))))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


# ---- a wrong or partial checkpoint fails at startup, naming the file and the field/tensor ------


def _copy(tiny: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(tiny, dst)
    return dst


def _edit_json(path: Path, fn) -> None:
    c = json.loads(path.read_text())
    fn(c)
    path.write_text(json.dumps(c))


def _edit_tensors(path: Path, fn) -> None:
    t = load_file(str(path))
    fn(t)
    save_file(t, str(path))


@pytest.mark.parametrize("case, expect", [
    ("audio_config_key", r"config.json audio_config: unknown key 'audio_magic'"),
    ("tokenizer_key", r"audio_tokenizer/config.json: unknown key 'encoder_magic'"),
    ("partial_rotary", r"partial_rotary_factor=0.5 is not supported"),
    ("activation", r"audio_tokenizer/config.json: activation_function='relu' is not supported"),
    ("vocab_too_small", r"speech_vocab_size\[0\]=20 cannot embed codebook 0 of 32 codes"),
    ("segment", r"audio_segment_size 810 gives 203 codes, not a multiple of group_size 4"),
    ("lm_hidden", r"out_hidden_size 64 != the LM hidden_size 96"),
    ("missing_main", r"model.safetensors: tensor 'audio_encoder.projection.mlp.2.weight' is missing"),
    ("missing_codebook", r"audio_tokenizer/model.safetensors: tensor 'encoder.quantizer.vq.layers.7._codebook.embed' is missing"),
    ("shape", r"model.safetensors: tensor 'speech_embeddings.3.weight' has shape \[41, 32\], the configs imply \[40, 32\]"),
    ("unexpected", r"audio_tokenizer/model.safetensors: tensor 'encoder.layers.0.self_attn.k_proj.bias' is not part"),
    ("no_tokenizer", r"audio_tokenizer/config.json not found"),
    ("fp8", r"model.safetensors: tensor 'audio_encoder.projection.mlp.0.weight_scale_inv': quantized \(FP8\)"),
])
def test_bad_checkpoint_fails_at_startup(tiny, tmp_path, case, expect):
    d = _copy(tiny, tmp_path / "ckpt")
    tok_json, tok_st, main = d / "audio_tokenizer/config.json", d / "audio_tokenizer/model.safetensors", d / "model.safetensors"
    lm_hidden = 64
    if case == "audio_config_key":
        _edit_json(d / "config.json", lambda c: c["audio_config"].update(audio_magic=1))
    elif case == "tokenizer_key":
        _edit_json(tok_json, lambda c: c.update(encoder_magic=1))
    elif case == "partial_rotary":
        _edit_json(d / "config.json", lambda c: c["audio_config"].update(partial_rotary_factor=0.5))
    elif case == "activation":
        _edit_json(tok_json, lambda c: c.update(activation_function="relu"))
    elif case == "vocab_too_small":
        _edit_json(d / "config.json", lambda c: c["audio_config"].update(speech_vocab_size="20", speech_zeroemb_idx="16"))
    elif case == "segment":
        _edit_json(d / "config.json", lambda c: c["audio_config"].update(audio_segment_size=810))
    elif case == "lm_hidden":
        lm_hidden = 96
    elif case == "missing_main":
        _edit_tensors(main, lambda t: t.pop("audio_encoder.projection.mlp.2.weight"))
    elif case == "missing_codebook":
        _edit_tensors(tok_st, lambda t: t.pop("encoder.quantizer.vq.layers.7._codebook.embed"))
    elif case == "shape":
        _edit_tensors(main, lambda t: t.update({"speech_embeddings.3.weight": torch.zeros(41, 32)}))
    elif case == "unexpected":
        _edit_tensors(tok_st, lambda t: t.update({"encoder.layers.0.self_attn.k_proj.bias": torch.zeros(32)}))
    elif case == "fp8":
        _edit_tensors(main, lambda t: t.update({"audio_encoder.projection.mlp.0.weight_scale_inv": torch.ones(4, 1)}))
    elif case == "no_tokenizer":
        import shutil

        shutil.rmtree(d / "audio_tokenizer")
    with pytest.raises(CheckpointError, match=expect):
        load_mimo_audio(d, torch.float32, lm_hidden)


def test_sharded_main_checkpoint_loads_the_same(tiny, tower, tmp_path):
    """The published checkpoint is sharded (``model.safetensors.index.json``): the tower tensors
    are found through the index wherever they live, and the tower is the same."""
    d = _copy(tiny, tmp_path / "sharded")
    t = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(t)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for f, part in shards.items():
        save_file({n: t[n] for n in part}, str(d / f))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}))
    s = load_mimo_audio(d, torch.float32, 64)
    x = one(s.prepare(chirp(1.0)))
    assert torch.equal(s(x), tower(x))
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors: shard named by"):
        load_mimo_audio(d, torch.float32, 64)


def test_mel_magnitude_is_a_plain_contiguous_tensor():
    """Callers save it with safetensors and stack it: never a transposed view."""
    m = mel_magnitude(torch.randn(24000), sr=24000, n_fft=960, win_length=960, hop=240, n_mels=128)
    assert m.shape == (128, 101) and m.is_contiguous()
