"""vLLM 0.32 (CPU) as the oracle of the MiMo-V2.5 omni vision path, on the tiny omni checkpoint.

``scripts/vllm_vit_oracle.py`` runs in vLLM's venv: pixels -> vLLM's ``MiMoVLProcessor``
(resize, normalize, temporal padding, patch order) -> vLLM's ``MiMoVisionTransformer`` (its
window blocks in Triton's interpreter), one varlen forward over every item; and the prompt ids
vLLM's processor writes for a video (timestamps, start/end tokens). We compare:

* patch rows: ours (``preprocess/mimo_vision.py``) == vLLM's, per image and per video;
* tower output: ours (``models/mimo_vit.py``, one item per temporal group) within 1e-4 of vLLM's;
* prompt ids: ours (``llm_svc/front/prompt.py`` + ``media_layout.py``) == vLLM's processor's.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

from encoder_svc.models.loader import load_models
from llm_svc.loading.loader import load_lm
from llm_svc.front.prompt import prepare_request
from shared.bundle import load_bundle_spec
from shared.schemas import GenerateRequest, MediaSegment, PromptMedia, PromptMessage, PromptText
from mmserve.tiny.mimo_omni import write_mimo_omni
from tests.integration.test_vllm_oracle import REPO, vllm_python  # noqa: F401 - the venv fixture

pytestmark = [pytest.mark.integration, pytest.mark.vllm]
ATOL = 1e-4
IMAGES = {"img.0": (100, 150), "img.1": (300, 200), "img.2": (20, 70)}  # plain, windows bite, upscale branch
VIDEO_TIMES = [0.0, 0.5, 1.0, 1.5, 62.0]  # odd: the last frame is repeated; a timestamp past a minute


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    return write_mimo_omni(tmp_path_factory.mktemp("omni-vllm") / "m")


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(0)
    out = {k: torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for k, (h, w) in IMAGES.items()}
    base = torch.randint(0, 256, (1, 3, 120, 160), generator=g).float()
    drift = torch.randint(-30, 30, (len(VIDEO_TIMES), 3, 120, 160), generator=g).float()
    out["vid.0"] = (base + drift).clamp(0, 255).to(torch.uint8)  # frames that differ, not unrelated noise
    out["vts.0"] = torch.tensor(VIDEO_TIMES)
    return out


def _prompt_parts() -> tuple[GenerateRequest, dict]:
    req = GenerateRequest(request_id="r", messages=[PromptMessage(role="user", content=[
        PromptText(text="what happens in"),
        PromptMedia(modality="video", index=0, content_hash="v", num_tokens=1),  # fixed below
        PromptText(text=" this video?")])])
    return req, {"prefix": "<|im_start|>user\nwhat happens in", "suffix": " this video?<|im_end|>\n<|im_start|>assistant\n"}


@pytest.fixture(scope="module")
def vllm_out(omni, inputs, vllm_python, tmp_path_factory):  # noqa: F811
    d = tmp_path_factory.mktemp("vit-io")
    save_file({k: v.contiguous() for k, v in inputs.items()}, str(d / "in.safetensors"))
    (d / "prompt.json").write_text(json.dumps(_prompt_parts()[1]))
    r = subprocess.run([vllm_python, str(REPO / "scripts" / "vllm_vit_oracle.py"), str(omni), str(d / "in.safetensors"),
                        str(d / "out.safetensors"), str(d / "prompt.json")],
                       capture_output=True, text=True, timeout=1200)
    if r.returncode != 0:
        pytest.fail(f"vllm_vit_oracle.py failed:\n{r.stderr[-4000:]}")
    return load_file(str(d / "out.safetensors"))


@pytest.fixture(scope="module")
def ours(omni, inputs):
    m = load_models(load_bundle_spec(omni))
    pre = m.vision.preprocess
    out = {}
    for k in IMAGES:
        out["patches." + k] = pre.image(inputs[k])  # [1, lh, lw, 4, P]
    frames = inputs["vid.0"]
    size = pre.video_size(frames.shape[-2], frames.shape[-1], len(frames))
    out["patches.vid.0"] = pre.video(torch.cat([frames, frames[-1:]]), size)  # [3, lh, lw, 4, P]
    for k in list(out):
        out["y." + k[len("patches."):]] = m.vision(out[k])  # batch = temporal groups, [G, lh*lw, H]
    return out


@pytest.mark.parametrize("item", [*IMAGES, "vid.0"])
def test_patch_rows_equal_vllm_processor(item, ours, vllm_out):
    p = ours["patches." + item]
    t, lh, lw, mm, dim = p.shape
    assert vllm_out["grid." + item].tolist() == [t, lh * 2, lw * 2]
    torch.testing.assert_close(p.reshape(-1, dim), vllm_out["patches." + item], rtol=0, atol=1e-4)


@pytest.mark.parametrize("item", [*IMAGES, "vid.0"])
def test_tower_output_matches_vllm(item, ours, vllm_out):
    a, b = ours["y." + item].reshape(-1, ours["y." + item].shape[-1]), vllm_out["y." + item]
    assert a.shape == b.shape and a.shape[0] > 1
    diff = (a - b).abs().max().item()
    assert diff < ATOL, f"{item}: max |ours - vLLM| = {diff:.2e}"
    assert b.abs().mean().item() > 0.05  # a comparison of real numbers, not zeros


def test_video_prompt_ids_equal_vllm_processor(omni, ours, vllm_out):
    lm = load_lm(str(omni), weights=False)
    groups = ours["y.vid.0"].shape[0]
    per = ours["y.vid.0"].shape[1]
    req, _ = _prompt_parts()
    media = req.messages[0].content[1].model_copy(update={
        "num_tokens": groups * per,
        "segments": [MediaSegment(start_s=VIDEO_TIMES[2 * g], num_tokens=per) for g in range(groups)]})
    req.messages[0].content[1] = media
    prep = prepare_request(lm, req, {"mm.0": torch.zeros(groups * per, lm.hidden_size)}, 4096)
    want = vllm_out["ids.vid.0"].tolist()
    assert prep.prompt_ids == want
    assert [n for _, n, _ in prep.mm_spans] == [per] * groups  # one span per temporal group
    assert "01:02" in lm.tokenizer.decode(prep.prompt_ids)
