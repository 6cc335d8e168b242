"""Draft verification (``llm_svc.engine.spec.verify``): greedy rules, the sampled rule's output
distribution (statistical, over a fixed set of seeds, so deterministic), agreement with the
sampler; the speculative config; the counters' arithmetic."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from llm_svc.engine.sampler import make_generator, sample
from llm_svc.engine.spec import SpeculativeConfig, SpecStats, verify, verify_batch
from shared.schemas import SamplingParams
from tests.unit.test_llm_sampler import _expected

pytestmark = pytest.mark.unit

GREEDY = SamplingParams()
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# --- greedy ----------------------------------------------------------------------------------

def _rows(*argmaxes: int, V: int = 10) -> torch.Tensor:
    """[len, V] logits whose row j peaks at argmaxes[j] (a clear margin), small noise elsewhere."""
    g = torch.Generator().manual_seed(len(argmaxes))
    x = torch.rand(len(argmaxes), V, generator=g)
    for j, a in enumerate(argmaxes):
        x[j, a] = 5.0
    return x


def test_greedy_all_drafts_accepted_then_the_bonus():
    assert verify(_rows(3, 4, 5, 6), [3, 4, 5], GREEDY, None) == [3, 4, 5, 6]


def test_greedy_stops_at_the_first_mismatch_with_the_argmax():
    logits = _rows(3, 4, 5, 6)
    assert verify(logits, [3, 9, 5], GREEDY, None) == [3, 4]
    assert verify(logits, [1, 4, 5], GREEDY, None) == [3]
    assert verify(logits, [3, 4, 1], GREEDY, None) == [3, 4, 5]


def test_greedy_without_drafts_is_the_argmax():
    assert verify(_rows(7), [], GREEDY, None) == [7]


def test_greedy_ties_take_the_lowest_id():
    logits = torch.zeros(2, 6)
    logits[0, [2, 4]] = 1.0
    logits[1, [1, 5]] = 1.0
    assert verify(logits, [4], GREEDY, None) == [2]
    assert verify(logits, [2], GREEDY, None) == [2, 1]


def test_greedy_rejects_ids_outside_the_vocabulary():
    assert verify(_rows(3, 4), [13], GREEDY, None) == [3]
    assert verify(_rows(3, 4), [-1], GREEDY, None) == [3]


def test_greedy_never_touches_the_generator():
    g = torch.Generator().manual_seed(5)
    before = g.get_state()
    verify(_rows(3, 4, 5), [3, 1], GREEDY, g)
    assert torch.equal(g.get_state(), before)


# --- sampled: the same as the sampler, and batch independence --------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_without_drafts_it_is_the_sampler(device):
    x = (torch.randn(1, 64, generator=torch.Generator().manual_seed(0)) * 3).to(device)
    for seed in range(40):
        sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.01, seed=seed)
        assert verify(x, [], sp, make_generator(sp, device)) == sample(x, [sp], [make_generator(sp, device)])
        # a cpu generator with logits elsewhere: the same draw as the sampler's
        assert verify(x, [], sp, make_generator(sp)) == sample(x, [sp], [make_generator(sp)])
        unseeded = sp.model_copy(update={"seed": None})
        torch.manual_seed(seed)
        want = sample(x, [unseeded], [None])
        torch.manual_seed(seed)
        assert verify(x, [], unseeded, None) == want


@pytest.mark.parametrize("device", DEVICES)
def test_batch_equals_one_request_at_a_time(device):
    V = 40
    rng = random.Random(0)
    drafts = [[rng.randrange(4) for _ in range(rng.randint(0, 4))] for _ in range(12)]
    params = [SamplingParams(temperature=rng.choice([0.0, 0.7, 1.0]), top_p=rng.choice([1.0, 0.9]),
                             top_k=rng.choice([-1, 5]), seed=i) for i in range(12)]
    logits = torch.randn(sum(len(d) + 1 for d in drafts), V, generator=torch.Generator().manual_seed(1))
    logits[:, :4] += 4.0  # the drafts (ids < 4) are often accepted
    logits = logits.to(device)
    batched = verify_batch(logits, drafts, params, [make_generator(sp, device) for sp in params])
    one_by_one, r = [], 0
    for d, sp in zip(drafts, params):
        one_by_one.append(verify(logits[r:r + len(d) + 1], d, sp, make_generator(sp, device)))
        r += len(d) + 1
    assert batched == one_by_one
    assert any(len(o) > 1 for o in batched)  # some drafts were accepted


def test_a_draft_with_all_the_mass_is_always_accepted():
    logits = torch.full((3, 8), -1e4)
    logits[0, 2] = logits[1, 6] = 0.0
    logits[2, 1] = 0.0
    sp = SamplingParams(temperature=1.0, top_k=1)
    for seed in range(20):
        assert verify(logits, [2, 6], sp, torch.Generator().manual_seed(seed)) == [2, 6, 1]


# --- sampled: the distribution of what comes out ---------------------------------------------

PROBS = [  # one target distribution per row (row 2: the bonus row), distinct probabilities
    [0.30, 0.22, 0.16, 0.12, 0.09, 0.06, 0.03, 0.02],
    [0.05, 0.10, 0.35, 0.20, 0.15, 0.08, 0.04, 0.03],
    [0.02, 0.04, 0.06, 0.08, 0.12, 0.16, 0.22, 0.30],
]
N_SEEDS = 20_000
MAX_ABS_DIFF = 0.015  # ~4 standard deviations of a frequency near 0.5 at 20k draws


@pytest.mark.parametrize("knobs", [dict(temperature=1.0, top_p=0.9), dict(temperature=0.7, top_k=3)],
                         ids=["t1-top_p0.9", "t0.7-top_k3"])
def test_emitted_tokens_follow_the_filtered_target(knobs):
    """For random drafts (in and out of the filtered support): the first token out is distributed
    as the filtered target p_0, the token at position j (when the output reaches it) as p_j; a
    rejected draft is never the token emitted in its place; the bonus only after every draft."""
    sp = SamplingParams(**knobs)
    expected = [_expected(p, **knobs) for p in PROBS]
    logits = torch.tensor([[math.log(q) for q in p] for p in PROBS]) + 1.7  # a shift changes nothing
    rng = random.Random(7)
    # likely tokens often enough that the bonus row is reached a few thousand times
    drafts = [[rng.choice([0, 0, 1, rng.randrange(8)]), rng.choice([2, 2, 3, rng.randrange(8)])]
              for _ in range(N_SEEDS)]
    outs = []
    for start in range(0, N_SEEDS, 1000):
        chunk = range(start, start + 1000)
        outs += verify_batch(logits.repeat(len(chunk), 1), [drafts[i] for i in chunk], [sp] * len(chunk),
                             [torch.Generator().manual_seed(i) for i in chunk])
    counts = [[0] * 8 for _ in PROBS]
    for d, out in zip(drafts, outs):
        assert 1 <= len(out) <= len(d) + 1
        m = len(out) - 1  # drafts kept
        assert out[:m] == d[:m]
        if m < len(d):
            assert out[m] != d[m]  # recovered from p without the rejected draft
            assert expected[m][out[m]] > 0
        for j, t in enumerate(out):
            counts[j][t] += 1
    for j in range(len(PROBS)):
        n = sum(counts[j])
        assert n > 1000, (j, n)
        freq = [c / n for c in counts[j]]
        tol = MAX_ABS_DIFF * math.sqrt(N_SEEDS / n)
        assert max(abs(f - e) for f, e in zip(freq, expected[j])) < tol, (j, freq, expected[j])
        assert all(c == 0 for c, e in zip(counts[j], expected[j]) if e == 0), (j, counts[j])


# --- config ----------------------------------------------------------------------------------

@pytest.mark.parametrize("off", [None, "", "  ", "null"])
def test_config_off(off):
    assert SpeculativeConfig.parse(off) is None


def test_config_ngram_defaults_follow_vllm():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 3, 5, 5)
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                                 "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (1, 3)
    assert c.to_dict() == {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                           "prompt_lookup_max": 3, "num_speculative_tokens_per_batch_size": None,
                           "draft_policy": "auto"}
    json.dumps(c.to_dict())


def test_config_method_spellings():
    assert SpeculativeConfig.parse({"model": "ngram", "num_speculative_tokens": 1}).method == "ngram"
    assert SpeculativeConfig.parse({"method": "[ngram]", "num_speculative_tokens": 1}).method == "ngram"
    c = SpeculativeConfig.parse({"method": "ngram", "model": "[ngram]", "num_speculative_tokens": 1})
    assert c.method == "ngram"
    c = SpeculativeConfig.parse({"method": "mimo_mtp", "num_speculative_tokens": 1})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("mtp", 0, 0)


def test_config_mtp_layers_fill_in_k():
    c = SpeculativeConfig.parse({"method": "mtp"})
    assert c.num_speculative_tokens is None
    assert c.with_mtp_layers(3).num_speculative_tokens == 3
    assert SpeculativeConfig("mtp", 2).with_mtp_layers(3).num_speculative_tokens == 2
    assert SpeculativeConfig("mtp", 6).with_mtp_layers(3).num_speculative_tokens == 6
    with pytest.raises(ValueError, match="num_speculative_tokens=4"):
        SpeculativeConfig("mtp", 4).with_mtp_layers(3)
    with pytest.raises(ValueError, match="MTP layers"):
        SpeculativeConfig("mtp").with_mtp_layers(0)
    ngram = SpeculativeConfig("ngram", 2)
    assert ngram.with_mtp_layers(3) is ngram


@pytest.mark.parametrize("value, names", [
    ({"method": "eagle", "num_speculative_tokens": 1}, "method"),
    ({"num_speculative_tokens": 1}, "method"),
    ({"method": ["ngram"], "num_speculative_tokens": 1}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
    ({"method": "mtp", "num_speculative_tokens": 1, "prompt_lookup_max": 3}, "prompt_lookup"),
    ({"method": "ngram", "num_speculative_tokens": 1, "lookahead": 2, "zeta": 1}, r"\['lookahead', 'zeta'\]"),
    ({"method": "ngram", "num_speculative_tokens": 1, "model": "some/draft-model"}, "model"),
    ({"method": "mtp", "num_speculative_tokens": 1, "rejection_sample_method": "synthetic"}, "rejection_sample_method"),
    ("[1, 2]", "JSON object"),
    ("{method: ngram}", "JSON"),
])
def test_config_refusals_name_the_field(value, names):
    with pytest.raises(ValueError, match=names):
        SpeculativeConfig.parse(value)


def test_config_ignores_vllm_execution_knobs_and_defaults():
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "enforce_eager": True,
                                 "disable_padded_drafter_batch": True, "draft_tensor_parallel_size": 1,
                                 "rejection_sample_method": "standard", "parallel_drafting": False})
    assert c == SpeculativeConfig("ngram", 2, 5, 5)


def test_config_is_frozen():
    c = SpeculativeConfig("ngram", 2)
    with pytest.raises(AttributeError):
        c.method = "mtp"


# --- stats -----------------------------------------------------------------------------------

def test_stats_arithmetic():
    s = SpecStats(3)
    assert s.as_dict()["mean_acceptance_length"] is None and s.acceptance_rate is None
    s.observe(3, 3)
    s.observe(3, 1)
    s.observe(2, 0)
    s.observe(0, 0)  # no draft: not counted
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 8, 4)
    assert s.accepted_per_pos == [2, 1, 1]
    assert s.drafted_per_pos == [3, 3, 2]
    d = s.as_dict()
    assert d["acceptance_rate"] == pytest.approx(4 / 8)
    assert d["mean_acceptance_length"] == pytest.approx(1 + 4 / 3)
    assert d["acceptance_rate_per_pos"] == pytest.approx([2 / 3, 1 / 3, 1 / 3])
    json.dumps(d)
    with pytest.raises(ValueError):
        s.observe(2, 3)
    with pytest.raises(ValueError):
        s.observe(4, 0)
