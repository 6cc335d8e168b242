"""Length buckets: replicas labelled with a prompt-length range get the prompts of that range."""

from __future__ import annotations

import pytest

from gateway.routing.capacity import ReplicaLimits, estimate_prompt_tokens
from shared.settings import LLMSettings, length_bucket_range

pytestmark = pytest.mark.unit


def _limits(lo: int, hi: int | None) -> dict:
    return {"status": "ok", "service": "llm", "limits": {
        "max_model_len": 1 << 20, "max_token_bytes": 16, "min_prompt_tokens": lo, "max_prompt_tokens": hi}}


def test_bucket_labels():
    assert length_bucket_range("short") == (0, 65536)
    assert length_bucket_range("medium") == (65536, 262144)
    assert length_bucket_range("long") == (262144, 1048576)
    assert length_bucket_range("10-20") == (10, 20)
    for bad in ("20-10", "x", "1-", "huge"):
        with pytest.raises(ValueError):
            length_bucket_range(bad)
    with pytest.raises(ValueError):
        LLMSettings(model_dir="/m", length_bucket="tiny")


def test_prompts_go_to_their_bucket_and_fall_back_upwards():
    book = ReplicaLimits()
    book.record("s", _limits(0, 65536))
    book.record("m", _limits(65536, 262144))
    book.record("l", _limits(262144, 1048576))
    every = ["s", "m", "l"]
    assert book.bucketed(every, 10) == ["s"]
    assert book.bucketed(every, 100_000) == ["m"]
    assert book.bucketed(every, 300_000) == ["l"]
    assert book.bucketed(["s", "l"], 100_000) == ["l"]  # no medium replica: the next bucket up
    assert book.bucketed(["s"], 100_000) == ["s"]  # nothing above: anyone
    book.record("any", {"status": "ok", "service": "llm"})  # unlabelled: holds every length
    assert book.bucketed(["s", "any"], 100_000) == ["any"]
    assert estimate_prompt_tokens(4000, 256) == 1256
