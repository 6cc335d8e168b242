"""Issue 11 item 7: the wire messages parsed from JSON per request or per streamed chunk do not
feed pydantic's process-wide JSON string cache with their values (unique request ids, text
deltas, content hashes), which grew every service by ~1.6 MB before it filled."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from shared.schemas import EncodeResult, GenerateChunk, GenerateRequest, GenerateResponse


class Plain(BaseModel):
    request_id: str


def twice(model, doc: dict):
    raw = json.dumps(doc)
    return model.model_validate_json(raw), model.model_validate_json(raw)


def test_a_plain_model_caches_its_values():
    a, b = twice(Plain, {"request_id": "req-7f3a"})
    assert a.request_id is b.request_id  # pydantic's default: the parser hands out the cached str


@pytest.mark.parametrize("model, doc", [
    (GenerateChunk, {"request_id": "req-1", "text": "delta"}),
    (GenerateResponse, {"request_id": "req-2", "text": "hi", "token_ids": [1], "finish_reason": "stop",
                        "prompt_tokens": 3, "completion_tokens": 1}),
    (GenerateRequest, {"request_id": "req-3", "messages": [{"role": "user", "content": [{"type": "text", "text": "x y"}]}]}),
    (EncodeResult, {"modality": "image", "content_hash": "ab12", "model": "m", "num_tokens": 4,
                    "hidden_size": 8}),
])
def test_wire_messages_do_not_cache_values(model, doc):
    a, b = twice(model, doc)
    field = "request_id" if "request_id" in doc else "content_hash"
    assert getattr(a, field) == getattr(b, field) and getattr(a, field) is not getattr(b, field)
