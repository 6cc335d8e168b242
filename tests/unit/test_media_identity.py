"""Media identity (issue 11 item 8): SHA-256 content hashes, and one media key -- content +
encoder model id + preprocessing signature -- that keys the encoder cache and the LLM's
prefix-cache keys of media tokens."""

from __future__ import annotations

import pytest
import torch

from llm_svc.front.prompt import prepare_request
from llm_svc.types.request import make_prompt_keys
from shared.hashing import content_hash, media_key
from shared.schemas import GenerateRequest, PromptMedia, PromptMessage, PromptText

pytestmark = pytest.mark.unit


def test_media_key_changes_with_model_preprocessing_and_content():
    d = content_hash(b"img")
    base = media_key("siglip@aaaa", "image", "img:224:bicubic", d)
    assert base.endswith(d) and base.startswith("siglip@aaaa:image:")
    assert media_key("siglip@bbbb", "image", "img:224:bicubic", d) != base  # encoder upgraded
    assert media_key("siglip@aaaa", "image", "img:336:bicubic", d) != base  # other preprocessing
    assert media_key("siglip@aaaa", "video", "img:224:bicubic", d) != base
    assert media_key("siglip@aaaa", "image", "img:224:bicubic", content_hash(b"img2")) != base
    assert media_key("siglip@aaaa", "image", "img:224:bicubic", d) == base  # stable


def _request(key: str | None, hidden: int) -> tuple[GenerateRequest, dict]:
    media = PromptMedia(modality="image", index=0, content_hash=content_hash(b"same bytes"), num_tokens=4, key=key)
    req = GenerateRequest(request_id="r", messages=[PromptMessage(role="user", content=[PromptText(text="look"), media])])
    return req, {"mm.0": torch.zeros(4, hidden)}


def test_llm_prefix_keys_follow_the_media_key_not_just_the_bytes(mimo16):
    lm = mimo16
    old = prepare_request(lm, *_request("enc@v1:image:s:x", lm.hidden_size), 512)
    new = prepare_request(lm, *_request("enc@v2:image:s:x", lm.hidden_size), 512)
    legacy = prepare_request(lm, *_request(None, lm.hidden_size), 512)
    assert old.mm_hashes == ["enc@v1:image:s:x"] and legacy.mm_hashes == [content_hash(b"same bytes")]
    k_old = make_prompt_keys(old.prompt_ids, old.mm_spans, old.mm_hashes)
    k_new = make_prompt_keys(new.prompt_ids, new.mm_spans, new.mm_hashes)
    start, length, _ = old.mm_spans[0]
    assert k_old[:start] == k_new[:start]  # the text before the image is shared
    assert all(a != b for a, b in zip(k_old[start : start + length], k_new[start : start + length]))
