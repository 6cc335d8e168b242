"""The LLM side of the MiMo-V2.5 omni placeholders: image pads expand in place, a video becomes
its timestamped layout (one span and one prefix-cache identity per temporal group), a video
without segments is refused with a message that says what to do."""

from __future__ import annotations

import pytest
import torch

from llm_svc.types.errors import InvalidRequest
from llm_svc.loading.loader import load_lm
from llm_svc.front.prompt import prepare_request
from llm_svc.types.request import make_prompt_keys
from shared.schemas import GenerateRequest, MediaSegment, PromptMedia, PromptMessage, PromptText
from mmserve.tiny.mimo_omni import write_mimo_omni

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return load_lm(str(write_mimo_omni(tmp_path_factory.mktemp("omni-prompt") / "m")), weights=False)


def _req(*parts) -> GenerateRequest:
    return GenerateRequest(request_id="r", messages=[PromptMessage(role="user", content=list(parts))])


def _video(index: int, times: list[float], per: int, key: str = "vid") -> PromptMedia:
    return PromptMedia(modality="video", index=index, content_hash="c" + key, key=key, num_tokens=per * len(times),
                       segments=[MediaSegment(start_s=t, num_tokens=per) for t in times])


def input_embeds_rows(lm, prep):
    """Only the media rows matter here (the front has no weights): place them in zeros."""
    out = torch.zeros(len(prep.prompt_ids), lm.hidden_size)
    for start, n, item in prep.mm_spans:
        out[start : start + n] = prep.mm_items[item]
    return out


def test_image_then_video_layout(lm):
    tok = lm.tokenizer
    img = PromptMedia(modality="image", index=0, content_hash="ci", key="img", num_tokens=6)
    vid = _video(1, [0.0, 75.5], 4)
    tensors = {"mm.0": torch.randn(6, lm.hidden_size), "mm.1": torch.randn(8, lm.hidden_size)}
    prep = prepare_request(lm, _req(PromptText(text="look"), img, vid), tensors, 4096)
    text = tok.decode(prep.prompt_ids)
    assert "<|vision_start|>" + "<|image_pad|>" * 6 + "<|vision_end|>" in text
    assert ("<|mimo_video_start|>00:00<|vision_start|>" + "<|video_pad|>" * 4 + "<|vision_end|>01:15<|vision_start|>"
            + "<|video_pad|>" * 4 + "<|vision_end|><|mimo_video_end|>") in text
    assert [n for _, n, _ in prep.mm_spans] == [6, 4, 4]
    assert prep.mm_hashes == ["img", "vid/t0", "vid/t1"]
    emb = input_embeds_rows(lm, prep)
    for (start, n, item), want in zip(prep.mm_spans, (tensors["mm.0"], tensors["mm.1"][:4], tensors["mm.1"][4:])):
        assert torch.equal(emb[start : start + n], want) and torch.equal(prep.mm_items[item], want)


def test_groups_have_their_own_prefix_identity(lm):
    a = prepare_request(lm, _req(_video(0, [0.0, 1.0], 3, key="A")), {"mm.0": torch.ones(6, lm.hidden_size)}, 4096)
    keys = make_prompt_keys(a.prompt_ids, a.mm_spans, a.mm_hashes)
    (s0, n0, _), (s1, n1, _) = a.mm_spans
    assert set(keys[s0 : s0 + n0]).isdisjoint(keys[s1 : s1 + n1])  # row r of group 0 != row r of group 1
    b = prepare_request(lm, _req(_video(0, [0.0, 1.0], 3, key="B")), {"mm.0": torch.ones(6, lm.hidden_size)}, 4096)
    assert a.prompt_ids == b.prompt_ids and make_prompt_keys(b.prompt_ids, b.mm_spans, b.mm_hashes) != keys


def test_video_without_segments_is_refused(lm):
    vid = PromptMedia(modality="video", index=0, content_hash="c", num_tokens=8)
    with pytest.raises(InvalidRequest, match="needs its timestamped segments"):
        prepare_request(lm, _req(vid), {"mm.0": torch.randn(8, lm.hidden_size)}, 4096)


def test_layout_counts_against_max_model_len(lm):
    vid = _video(0, [float(t) for t in range(10)], 4)  # 40 rows + timestamps and start/end tokens
    with pytest.raises(InvalidRequest, match="max_model_len=90"):
        prepare_request(lm, _req(vid), {"mm.0": torch.randn(40, lm.hidden_size)}, 90)
