"""The OpenAI / vLLM sampling knobs on the logits: logit_bias, presence / frequency / repetition
penalties (against a per-token reference written from vLLM's definition), min_p, top_logprobs,
and the engine applying them to greedy requests of a real tiny model."""

from __future__ import annotations

import math
import random

import pytest
import torch

from llm_svc.engine.logits_procs import TokenHistory, apply_bias_and_penalties, penalised, top_logprobs
from llm_svc.engine.sampler import make_generator, sample
from shared.schemas import SamplingParams

pytestmark = pytest.mark.unit


def _reference(logits: list[float], sp: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    """One row, token by token: bias, then repetition (prompt + output), frequency, presence."""
    x = list(logits)
    for t, b in sp.logit_bias.items():
        x[t] += b
    for t in range(len(x)):
        if t in prompt or t in output:
            r = sp.repetition_penalty
            x[t] = x[t] / r if x[t] > 0 else x[t] * r
        c = output.count(t)
        x[t] -= sp.frequency_penalty * c + sp.presence_penalty * (c > 0)
    return x


@pytest.mark.parametrize("seed", range(12))
def test_bias_and_penalties_match_the_per_token_reference(seed):
    rng = random.Random(seed)
    V, B = 37, 5
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(seed))
    params, hist, ctx = [], [], []
    for _ in range(B):
        kw = {}
        if rng.random() < 0.7:
            kw["repetition_penalty"] = rng.choice([0.5, 1.0, 1.3, 2.0])
        if rng.random() < 0.7:
            kw["frequency_penalty"] = rng.uniform(-2, 2)
        if rng.random() < 0.7:
            kw["presence_penalty"] = rng.uniform(-2, 2)
        if rng.random() < 0.6:
            kw["logit_bias"] = {rng.randrange(V): rng.uniform(-100, 100) for _ in range(rng.randint(1, 4))}
        sp = SamplingParams(**kw)
        prompt = [rng.randrange(V) for _ in range(rng.randint(1, 9))]
        output = [rng.randrange(V) for _ in range(rng.randint(0, 12))]
        h = None
        if penalised(sp):  # built from the first output tokens, the rest added one by one (as the engine does)
            h = TokenHistory.start(prompt, output[:2], V, torch.device("cpu"))
            for t in output[2:]:
                h.add(t)
        params.append(sp)
        hist.append(h)
        ctx.append((prompt, output))
    before = logits.clone()
    got = apply_bias_and_penalties(logits, params, hist)
    assert torch.equal(logits, before)  # the raw logits stay raw (logprobs read them)
    for r, sp in enumerate(params):
        want = _reference(logits[r].tolist(), sp, *ctx[r])
        torch.testing.assert_close(got[r], torch.tensor(want), atol=1e-5, rtol=1e-5)


def test_no_knob_is_no_work():
    logits = torch.randn(3, 11)
    assert apply_bias_and_penalties(logits, [SamplingParams()] * 3, [None] * 3) is logits


def test_a_large_negative_bias_bans_the_greedy_token():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.9]])
    assert sample(logits, [SamplingParams()], [None]) == [1]
    x = apply_bias_and_penalties(logits, [SamplingParams(logit_bias={1: -100.0})], [None])
    assert sample(x, [SamplingParams()], [None]) == [3]


def test_min_p_keeps_only_tokens_near_the_top():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, -1).contiguous()
    sp = SamplingParams(temperature=1.0, min_p=0.35)  # keeps p >= 0.175: tokens 0 and 1
    params = [sp.model_copy(update={"seed": s}) for s in range(4000)]
    toks = sample(logits, params, [make_generator(p) for p in params])
    assert set(toks) == {0, 1}
    share = toks.count(0) / len(toks)
    assert abs(share - 0.5 / 0.8) < 0.03
    # min_p after the temperature (vLLM's order): a hot temperature flattens the row first
    hot = SamplingParams(temperature=2.0, min_p=0.35, seed=0)
    hot_params = [hot.model_copy(update={"seed": s}) for s in range(4000)]
    assert set(sample(logits, hot_params, [make_generator(p) for p in hot_params])) == {0, 1, 2}


def test_top_logprobs_are_the_raw_log_softmax():
    raw = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    got = top_logprobs(raw, [7, 0, 49], [0, 3, 20])
    lp = torch.log_softmax(raw, -1)
    for r, (chosen, k) in enumerate(zip([7, 0, 49], [0, 3, 20])):
        mine, top = got[r]
        assert math.isclose(mine, float(lp[r, chosen]), abs_tol=1e-6)
        assert len(top) == k
        want = torch.topk(lp[r], k) if k else None
        if k:
            assert [t for t, _ in top] == want.indices.tolist()
            assert all(math.isclose(v, w, abs_tol=1e-6) for (_, v), w in zip(top, want.values.tolist()))


def test_sampling_params_refuse_out_of_range_knobs():
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0},
                {"min_p": 1.5}, {"logit_bias": {3: 101.0}}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
