"""Prompt logprobs in the engine (``sampling.prompt_logprobs``): transformers' log-softmax of the
whole prompt's logits whatever the chunking, the same with a warm prefix cache (a request scoring
its prompt takes no hit, and still fills the cache) and across a preemption mid-prefill; a
``max_tokens=0`` request ends with its prefill; requests without the flag are untouched."""

from __future__ import annotations

import pytest
import torch

from llm_svc.backends.hf import generate_kwargs, media_rows_injected
from tests.integration.test_llm_engine import ListStream, image_prep, make_engine, run_to_end

pytestmark = pytest.mark.integration
K = 3
ATOL = 1e-4


def prompt_entries(stream) -> list:
    got = [o.prompt_logprobs for o in stream.outs if o.prompt_logprobs is not None]
    assert len(got) == 1, "prompt logprobs come once, on the first output"
    return got[0]


def hf_prompt_logprobs(lm, prep) -> list[tuple[float, list[int]]]:
    """Per prompt position 1..P-1: (logprob of the prompt token, ids of the top K), from one
    transformers forward over the whole prompt."""
    with torch.no_grad(), media_rows_injected(lm, prep):
        logits = lm.model(**generate_kwargs(lm, prep)).logits[0].float()  # [P, V]
    lp = torch.log_softmax(logits, dim=-1)
    ids = prep.prompt_ids
    return [(float(lp[p - 1, ids[p]]), lp[p - 1].topk(K).indices.tolist()) for p in range(1, len(ids))]


def assert_close(entries, ref, prompt_ids) -> None:
    assert len(entries) == len(prompt_ids)
    assert entries[0].logprob is None and entries[0].token_id == prompt_ids[0] and not entries[0].top
    for e, t, (lp, top) in zip(entries[1:], prompt_ids[1:], ref):
        assert e.token_id == t and abs(e.logprob - lp) < ATOL, (e, lp)
        assert [a.token_id for a in e.top] == top
        assert (e.rank == 1) == (t == top[0]) and e.rank >= 1, (e, top)


def workload(lm, **sampling):
    return [image_prep(lm, "long", 150, None, 1, max_tokens=4, **sampling),  # many chunks, > 9 windows
            image_prep(lm, "img", 40, 5, 2, max_tokens=4, **sampling),
            image_prep(lm, "one", 1, None, 3, max_tokens=2, **sampling)]


@pytest.mark.parametrize("arch", ["mimo", "gemma3"])
def test_chunked_and_whole_prompts_score_as_transformers(arch, mimo16, gemma16):
    lm = mimo16 if arch == "mimo" else gemma16
    preps = workload(lm, prompt_logprobs=K)
    refs = {p.request_id: hf_prompt_logprobs(lm, p) for p in preps}
    plain = run_to_end(make_engine(lm, max_batch_tokens=256), workload(lm))
    for chunk in (16, 256):
        streams = run_to_end(make_engine(lm, max_batch_tokens=chunk), workload(lm, prompt_logprobs=K))
        for p in preps:
            assert_close(prompt_entries(streams[p.request_id]), refs[p.request_id], p.prompt_ids)
            assert streams[p.request_id].tokens == plain[p.request_id].tokens, (chunk, p.request_id)


def test_a_warm_prefix_cache_gives_the_same_prompt_logprobs(mimo16):
    lm = mimo16
    engine = make_engine(lm, max_batch_tokens=32)
    cold = run_to_end(engine, [image_prep(lm, "cold", 150, None, 1, max_tokens=4, prompt_logprobs=K)])["cold"]
    assert cold.outs[-1].cached_tokens == 0
    # the scoring request filled the cache: a plain twin hits it; a scoring twin takes no hit
    warm = run_to_end(engine, [image_prep(lm, "plain", 150, None, 1, max_tokens=4)])["plain"]
    assert warm.outs[-1].cached_tokens > 100 and warm.tokens == cold.tokens
    again = run_to_end(engine, [image_prep(lm, "again", 150, None, 1, max_tokens=4, prompt_logprobs=K)])["again"]
    assert again.outs[-1].cached_tokens == 0 and again.tokens == cold.tokens
    for a, b in zip(prompt_entries(again), prompt_entries(cold)):
        assert a.token_id == b.token_id and a.rank == b.rank and [t.token_id for t in a.top] == [t.token_id for t in b.top]
        assert a.logprob is None and b.logprob is None or abs(a.logprob - b.logprob) < ATOL


def test_preemption_mid_prefill_scores_each_position_once(mimo16):
    """A request preempted after two chunks recomputes from what the cache holds (no further
    than it scored); its prompt logprobs equal an undisturbed run's."""
    lm = mimo16
    prep = image_prep(lm, "pre", 150, None, 1, max_tokens=4, prompt_logprobs=K)
    ref = hf_prompt_logprobs(lm, prep)
    engine = make_engine(lm, max_batch_tokens=16)
    s = ListStream("pre")
    engine.submit(prep, s)
    sched = engine.scheduler
    while sched.requests["pre"].num_computed < 32:
        engine.step()
    req = sched.requests["pre"]
    assert req.prompt_scored == 32
    sched._preempt(req)
    sched.check_integrity()
    engine.step()  # re-admitted: the cache holds what it computed, a hit no further than it scored
    assert 0 < req.kv.cached_len <= 32
    for _ in range(200):
        if s.done:
            break
        engine.step()
        sched.check_integrity()
    assert s.done and sched.num_preemptions == 1
    assert_close(prompt_entries(s), ref, prep.prompt_ids)
    assert s.outs[-1].completion_tokens == 4


def test_max_tokens_zero_ends_with_the_prefill(mimo16):
    lm = mimo16
    engine = make_engine(lm, max_batch_tokens=16)
    p = image_prep(lm, "zero", 40, None, 4, max_tokens=0, prompt_logprobs=0)
    s = run_to_end(engine, [p])["zero"]
    assert s.tokens == [] and s.outs[-1].finish_reason == "length" and s.outs[-1].completion_tokens == 0
    entries = prompt_entries(s)
    assert len(entries) == 40 and all(not e.top for e in entries)
    ref = hf_prompt_logprobs(lm, p)
    assert max(abs(e.logprob - lp) for e, (lp, _) in zip(entries[1:], ref)) < ATOL
    engine.scheduler.check_integrity()


def test_requests_without_the_flag_are_untouched(mimo16):
    """Mixed in one batch with scoring requests, plain requests get the tokens they get alone,
    no prompt logprobs, and the bookkeeping holds (``run_to_end`` checks it every step)."""
    lm = mimo16
    alone = run_to_end(make_engine(lm, max_batch_tokens=32), workload(lm))
    scoring = [image_prep(lm, f"s{i}", 60 + 9 * i, None, 20 + i, max_tokens=3, prompt_logprobs=2) for i in range(3)]
    engine = make_engine(lm, max_batch_tokens=32)
    mixed = run_to_end(engine, workload(lm) + scoring)
    for rid, s in alone.items():
        assert mixed[rid].tokens == s.tokens, rid
        assert all(o.prompt_logprobs is None for o in mixed[rid].outs)
    for p in scoring:
        assert len(prompt_entries(mixed[p.request_id])) == len(p.prompt_ids)
    assert engine.scheduler.stats()["running"] == 0
    engine.scheduler.check_integrity()
