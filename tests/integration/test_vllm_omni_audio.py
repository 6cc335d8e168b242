"""The MiMo-V2.5 omni audio tower vs vLLM 0.32's (``mimo_audio.py`` + the MiMo processor) on the
same tiny published-layout checkpoint: placeholder counts equal, the tokenizer's continuous
features within 1e-4, RVQ codes equal, LM-space embeddings within 1e-4, and the LLM's prompt ids
for a chat with a clip equal to the ids vLLM's processor writes.

vLLM runs in its own venv in a subprocess (``scripts/vllm_mimo_audio_oracle.py``; what in it is a
stand-in, and why, is said there). Each clip goes to vLLM alone: vLLM's packed batch makes the
LAST code frame of an odd-length segment depend on the batch (conv2 and the 2x pool read the
neighbour's padding where a lone segment reads zeros); ours always computes the lone value.
That difference is asserted too, so it stays known: only that frame, only that row differs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from encoder_svc.models.mimo_audio_weights import load_mimo_audio
from encoder_svc.preprocess.mimo_mel import mel_magnitude
from mmserve.tiny.mimo_omni import write_mimo_omni
from tests.integration.test_vllm_oracle import vllm_python  # noqa: F401  (the venv fixture)
from mmserve.testing.audio import chirp

pytestmark = [pytest.mark.integration, pytest.mark.vllm]
REPO = Path(__file__).resolve().parents[2]
ATOL = 1e-4
# seconds -> mel frames: 2.0 s 201 (odd), 0.75 s 76, 1.01 s 102 (51 conv frames: odd pool), 19.996 s = 2000 frames
# (segments 800 + 800 + 400, all even), 20 s = 2001 frames (800 + 800 + 401: odd tail)
CLIPS = (2.0, 0.75, 1.01, 1999 * 240 / 24000, 20.0)
PROMPT = {"prefix": "<|im_start|>user\nwhat is said in", "suffix": " this clip?<|im_end|>\n<|im_start|>assistant\n"}


@pytest.fixture(scope="module")
def run(vllm_python, tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm-audio")
    ckpt = write_mimo_omni(d / "ckpt", seed=3)  # the whole tiny omni checkpoint, as published
    tower = load_mimo_audio(ckpt, torch.float32, json.loads((ckpt / "config.json").read_text())["hidden_size"])
    t = tower.tok_cfg
    waves = [chirp(s, seed=i) for i, s in enumerate(CLIPS)]
    mags = {f"mag.{i}": mel_magnitude(w, sr=t.sampling_rate, n_fft=t.nfft, win_length=t.window_size,
                                      hop=t.hop_length, n_mels=t.n_mels) for i, w in enumerate(waves)}
    save_file(mags, str(d / "in.safetensors"))
    (d / "prompt.json").write_text(json.dumps(PROMPT))
    proc = subprocess.run([vllm_python, str(REPO / "scripts" / "vllm_mimo_audio_oracle.py"), str(ckpt),
                           str(d / "in.safetensors"), str(d / "out.safetensors"), str(d / "prompt.json")],
                          capture_output=True, text=True,
                          timeout=900, env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        pytest.fail(f"vLLM oracle failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return tower, waves, load_file(str(d / "out.safetensors")), ckpt


def ours(tower, wave):
    items = tower.prepare(wave)
    embeds = items.kept([tower(g) for g in items.groups])
    feats, codes = [], []
    for x in items.groups:
        h, n = tower.tokenizer.features(x[:, :-1], (x[:, -1] > 0.5).sum(-1))
        c = tower.tokenizer.quantize(h, tower.enc_cfg.audio_channels)
        feats += [h[k, : n[k]] for k in range(len(n))]
        codes += [c[k, : n[k]] for k in range(len(n))]
    return items, torch.cat(feats), torch.cat(codes), embeds


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("i", range(len(CLIPS)))
def test_audio_tower_matches_vllm(run, i):
    tower, waves, ref, _ = run
    items, feats, codes, embeds = ours(tower, waves[i])
    assert sum(items.tokens) == int(ref[f"tokens.{i}"]) == ref[f"embeds.{i}"].shape[0] == embeds.shape[0]
    odd_tail = len(items.tokens) > 1 and int((items.groups[-1][-1, -1] > 0.5).sum()) % 2 == 1
    keep = slice(0, -1) if odd_tail else slice(None)  # see the module docstring
    fdiff = (feats[keep] - ref[f"feats.{i}"][keep]).abs().max().item()
    ediff = (embeds[keep] - ref[f"embeds.{i}"][keep]).abs().max().item()
    print(f"\n[vllm-audio] clip {i} ({CLIPS[i]:.2f} s, {len(items.tokens)} segments): {embeds.shape[0]} tokens, "
          f"features max|diff| {fdiff:.1e}, codes equal {torch.equal(codes[keep], ref[f'codes.{i}'][keep])}, "
          f"embeds max|diff| {ediff:.1e}", file=sys.stderr)
    assert codes[:, 0].unique().numel() > 4  # varied codes: equal codes then mean something
    assert fdiff < ATOL
    assert torch.equal(codes[keep], ref[f"codes.{i}"][keep])
    assert ediff < ATOL
    if odd_tail:  # the one known difference is where it is said to be, and only there
        assert not torch.equal(feats[-1], ref[f"feats.{i}"][-1])


def test_vllm_batch_is_batch_dependent_ours_is_not(run):
    """All clips in ONE vLLM call: its rows for the single-segment odd-length clips change
    (their last conv/pool frame now reads the 6000-frame neighbours' padding); ours are the
    alone values by construction (``tests/unit/test_omni_audio.py`` checks batch independence)."""
    tower, waves, ref, _ = run
    lens = ref["batch_lens"].tolist()
    rows = torch.split(ref["batch_embeds"], lens)
    assert lens == [int(ref[f"tokens.{i}"]) for i in range(len(CLIPS))]
    for i, r in enumerate(rows):
        alone = ref[f"embeds.{i}"]
        assert torch.allclose(r[:-1], alone[:-1], atol=ATOL), i  # all but the last row agree
    assert any(not torch.allclose(r[-1], ref[f"embeds.{i}"][-1], atol=ATOL) for i, r in enumerate(rows))


@pytest.mark.parametrize("i", [0, 4])
def test_audio_prompt_ids_equal_vllm_processor(run, i):
    """The LLM's prompt for a chat with one clip (``llm_svc/front/prompt.py`` from the checkpoint's own
    tokenizer and placeholders) == the ids vLLM's MiMo processor writes: start, n pads, end."""
    from llm_svc.loading.loader import load_lm
    from llm_svc.front.prompt import prepare_request
    from shared.schemas import GenerateRequest, PromptMedia, PromptMessage, PromptText

    tower, waves, ref, ckpt = run
    n = int(ref[f"tokens.{i}"])
    lm = load_lm(str(ckpt), weights=False)
    req = GenerateRequest(request_id="r", messages=[PromptMessage(role="user", content=[
        PromptText(text="what is said in"), PromptMedia(modality="audio", index=0, content_hash="a", num_tokens=n),
        PromptText(text=" this clip?")])])
    prep = prepare_request(lm, req, {"mm.0": torch.zeros(n, lm.hidden_size)}, 4096)
    want = ref[f"ids.{i}"].tolist()
    assert prep.prompt_ids == want
    pad = lm.tokenizer.convert_tokens_to_ids("<|audio_pad|>")
    assert want.count(pad) == n and [k for _, k, _ in prep.mm_spans] == [n]
