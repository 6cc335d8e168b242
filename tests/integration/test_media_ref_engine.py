"""The swa engine with media sent by reference: a multi-turn image conversation fetches each
image once (turn 2's re-sent image is covered by the prefix cache), the tokens equal the
by-value run with the prefix cache off, a fetch that never comes fails the request after the
deadline, and the bookkeeping stays sound throughout."""

from __future__ import annotations

import time

import pytest
import torch

from llm_svc.types.request import EmbeddingRef, PreparedRequest
from shared.schemas import SamplingParams
from tests.integration.test_llm_engine import ListStream, make_engine, run_to_end

pytestmark = pytest.mark.integration


def conversation(lm, by_ref: bool, seed: int = 0) -> tuple[list[PreparedRequest], list[torch.Tensor]]:
    """Turn 1: text + image A; turn 2: turn 1 + answer + text + image B (A re-sent)."""
    g = torch.Generator().manual_seed(seed)
    pad, n = lm.pad_ids["image"], 16
    text = lambda k: torch.randint(20, lm.vocab_size, (k,), generator=g).tolist()  # noqa: E731
    imgs = [torch.randn(n, lm.hidden_size, generator=g) for _ in range(2)]
    ids1 = text(9) + [pad] * n + text(7)
    ids2 = ids1 + text(12) + [pad] * n + text(5)
    spans1, spans2 = [(9, n, 0)], [(9, n, 0), (len(ids1) + 12, n, 1)]

    def prep(rid, ids, spans, k):
        items = [None] * k if by_ref else [imgs[i].clone() for i in range(k)]
        refs = [EmbeddingRef(f"enc:image:sig:{i}", ("http://enc",), n) for i in range(k)] if by_ref else []
        return PreparedRequest(request_id=rid, prompt_ids=ids, sampling=SamplingParams(max_tokens=6, ignore_eos=True),
                               mm_items=items, mm_refs=refs, mm_spans=spans, mm_hashes=[f"img{i}" for i in range(k)])

    return [prep("t1", ids1, spans1, 1), prep("t2", ids2, spans2, 2)], imgs


def test_turn_two_fetches_only_the_new_image_and_matches_by_value(mimo16):
    lm = mimo16
    (t1, t2), imgs = conversation(lm, by_ref=True)
    asked: list[tuple[str, list[int]]] = []

    def fetch(rid, items):
        asked.append((rid, list(items)))
        return {i: imgs[i].clone() for i in items}

    engine = make_engine(lm)
    engine.media = fetch  # what the front's fetcher does, synchronously
    out1 = run_to_end(engine, [t1])["t1"]
    out2 = run_to_end(engine, [t2])["t2"]
    assert asked == [("t1", [0]), ("t2", [1])]  # image A of turn 2 came from the prefix cache
    assert out2.outs[-1].cached_tokens >= len(t1.prompt_ids) - 1
    engine.scheduler.check_integrity()

    (v1, v2), _ = conversation(lm, by_ref=False)
    ref = make_engine(lm, enable_prefix_cache=False)
    assert run_to_end(ref, [v1])["t1"].tokens == out1.tokens
    assert run_to_end(ref, [v2])["t2"].tokens == out2.tokens


def test_media_that_never_arrives_fails_after_the_deadline(mimo16):
    lm = mimo16
    (t1, _), _ = conversation(lm, by_ref=True)
    engine = make_engine(lm)  # nobody answers the need
    engine.engine.media_timeout = 0.2
    streams = {"t1": ListStream("t1")}
    engine.submit(t1, streams["t1"])
    deadline = time.monotonic() + 10
    while not streams["t1"].done and time.monotonic() < deadline:
        engine.step()
        engine.scheduler.check_integrity()
        assert engine.engine.stalled() or streams["t1"].done
        time.sleep(0.01)
    final = streams["t1"].outs[-1]
    assert final.error and final.error_status == 504
    assert not engine.engine.has_work() and engine.engine.num_live == 0
    engine.scheduler.check_integrity()
