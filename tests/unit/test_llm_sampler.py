"""The sampler: greedy, temperature, top-k, top-p, seeds, batch independence, distributions, devices."""

from __future__ import annotations

import math

import pytest
import torch

from llm_svc.engine.sampler import make_generator, sample, suppress
from shared.schemas import SamplingParams

pytestmark = pytest.mark.unit

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# a 5-token distribution with distinct probabilities, so every filter changes it visibly
BASE_PROBS = [0.40, 0.25, 0.18, 0.12, 0.05]
N_DRAWS = 20_000
MAX_ABS_DIFF = 0.015  # ~4 standard deviations of a frequency near 0.5 at 20k draws


def _expected(probs: list[float], temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0) -> list[float]:
    """The reference distribution, written independently of the sampler (plain Python)."""
    w = [math.exp(math.log(p) / temperature) for p in probs]
    w = [x / sum(w) for x in w]
    order = sorted(range(len(w)), key=lambda i: -w[i])
    keep = set(order[:top_k] if top_k > 0 else order)
    if top_p < 1.0:
        ranked = [i for i in order if i in keep]
        tot = sum(w[i] for i in ranked)
        nucleus, mass = [], 0.0
        for i in ranked:
            nucleus.append(i)
            mass += w[i] / tot
            if mass >= top_p:  # the token that crosses top_p is kept
                break
        keep = set(nucleus)
    out = [w[i] if i in keep else 0.0 for i in range(len(w))]
    return [x / sum(out) for x in out]


def _frequencies(tokens: list[int], vocab: int) -> list[float]:
    counts = [0] * vocab
    for t in tokens:
        counts[t] += 1
    return [c / len(tokens) for c in counts]


def _draw_seeded(sp: SamplingParams, n: int = N_DRAWS, device: str = "cpu") -> list[int]:
    """n draws, one per row of one batch, each row its own seeded generator (seeds 0..n-1)."""
    logits = torch.tensor(BASE_PROBS, device=device).log().expand(n, -1).contiguous()
    params = [sp.model_copy(update={"seed": s}) for s in range(n)]
    return sample(logits, params, [make_generator(p, device) for p in params])


# ------------------------------------------------------------------ greedy and degenerate cases
def test_greedy_and_degenerate_sampling_take_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2, -1.0], [2.0, 0.0, 5.0, 1.0]])
    greedy = SamplingParams()
    top1 = SamplingParams(temperature=1.5, top_k=1)
    tiny_p = SamplingParams(temperature=1.0, top_p=1e-6)
    out = sample(logits, [greedy, top1], [None, make_generator(top1)])
    assert out == [1, 2]
    assert sample(logits[1:], [tiny_p], [make_generator(tiny_p)]) == [2]


def test_greedy_ties_take_the_lowest_id():
    logits = torch.tensor([[1.0, 7.0, 7.0, 7.0], [9.0, 9.0, 0.0, 9.0]])
    assert sample(logits, [SamplingParams()] * 2, [None, None]) == [1, 0]


def test_temperature_zero_is_greedy_even_with_a_seed():
    sp = SamplingParams(temperature=0.0, seed=5, top_k=3)
    assert make_generator(sp) is None
    logits = torch.tensor([[0.0, 0.5, 0.4]])
    assert sample(logits, [sp], [None]) == [1]


def test_tiny_temperature_is_argmax_and_never_nan():
    logits = torch.tensor([[100.0, 300.0, 299.0, -50.0]])
    sp = SamplingParams(temperature=1e-30, seed=1)
    g = make_generator(sp)
    assert [sample(logits, [sp], [g])[0] for _ in range(50)] == [1] * 50


def test_greedy_rows_unaffected_by_sampled_neighbours():
    torch.manual_seed(0)
    logits = torch.randn(6, 40)
    want = logits.argmax(-1).tolist()
    hot = SamplingParams(temperature=5.0)
    params = [SamplingParams() if i % 2 == 0 else hot for i in range(6)]
    gens = [make_generator(p) for p in params]
    for _ in range(20):
        out = sample(logits, params, gens)
        assert [out[i] for i in (0, 2, 4)] == [want[i] for i in (0, 2, 4)]
    # and the sampled rows really were random (a sampler that argmaxed everything fails here)
    seen = {tuple(sample(logits, params, gens)[1::2]) for _ in range(20)}
    assert len(seen) > 1


# ------------------------------------------------------------------ seeds
def test_seeded_sampling_reproducible_and_restricted_to_top_k():
    logits = torch.zeros(1, 50)
    logits[0, 10] = logits[0, 20] = logits[0, 30] = 4.0
    sp = SamplingParams(temperature=1.0, top_k=3, seed=123)
    g1, g2 = make_generator(sp), make_generator(sp)
    a = [sample(logits, [sp], [g1])[0] for _ in range(60)]
    b = [sample(logits, [sp], [g2])[0] for _ in range(60)]
    assert a == b
    assert set(a) == {10, 20, 30}


def test_different_seeds_give_different_sequences():
    logits = torch.zeros(1, 1000)
    seqs = set()
    for seed in range(4):
        sp = SamplingParams(temperature=1.0, seed=seed)
        g = make_generator(sp)
        seqs.add(tuple(sample(logits, [sp], [g])[0] for _ in range(10)))
    assert len(seqs) == 4


@pytest.mark.parametrize("seed", [0, 1, -1, -(2**70), 2**63, 2**64 - 1, 2**64 + 7, 10**40])
def test_any_int_seed_is_accepted_and_reduced_mod_2_64(seed):
    logits = torch.zeros(1, 1000)
    a, b = SamplingParams(temperature=1.0, seed=seed), SamplingParams(temperature=1.0, seed=seed + 2**64)
    ga, gb = make_generator(a), make_generator(b)
    assert [sample(logits, [a], [ga])[0] for _ in range(5)] == [sample(logits, [b], [gb])[0] for _ in range(5)]


def test_unseeded_generators_differ():
    sp = SamplingParams(temperature=1.0)
    logits = torch.zeros(1, 10_000)
    g1, g2 = make_generator(sp), make_generator(sp)
    assert [sample(logits, [sp], [g1])[0] for _ in range(5)] != [sample(logits, [sp], [g2])[0] for _ in range(5)]


def test_seeded_request_same_alone_and_in_any_batch():
    """A seeded request's tokens depend on its seed and logits only: not on batch size, its row,
    or its neighbours' parameters (greedy, unseeded, other seeds, other filters)."""
    torch.manual_seed(1)
    steps, V = 12, 64
    mine = [torch.randn(V) for _ in range(steps)]
    sp = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=42)

    g = make_generator(sp)
    alone = [sample(m.unsqueeze(0), [sp], [g])[0] for m in mine]

    others = [SamplingParams(), SamplingParams(temperature=1.3), SamplingParams(temperature=0.7, seed=7, top_k=5),
              SamplingParams(temperature=2.0, top_p=0.5), SamplingParams(temperature=1.0, top_k=50, top_p=0.95)]
    for row in (0, 2, 5):
        params = others[:row] + [sp] + others[row:]
        gens = [make_generator(p) for p in params]
        got = []
        for m in mine:
            logits = torch.randn(len(params), V)
            logits[row] = m
            got.append(sample(logits, params, gens)[row])
        assert got == alone, row


def test_top_k_zero_minus_one_and_vocab_are_all_off_and_top_p_one_is_off():
    torch.manual_seed(2)
    logits = torch.randn(1, 30)
    seqs = []
    for extra in ({}, {"top_k": 0}, {"top_k": -1}, {"top_k": 30}, {"top_k": 500}, {"top_p": 1.0}):
        sp = SamplingParams(temperature=1.0, seed=9, **extra)
        g = make_generator(sp)
        seqs.append([sample(logits, [sp], [g])[0] for _ in range(40)])
    assert all(s == seqs[0] for s in seqs)
    assert len(set(seqs[0])) > 5  # really sampled over the whole vocabulary


# ------------------------------------------------------------------ filters, per row
def test_top_p_keeps_the_nucleus_only():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    sp = SamplingParams(temperature=1.0, top_p=0.75, seed=0)
    g = make_generator(sp)
    seen = {sample(probs.log(), [sp], [g])[0] for _ in range(200)}
    assert seen == {0, 1}


def test_each_row_uses_its_own_filters():
    kinds = [{"top_k": 1}, {"top_k": 2}, {"top_p": 0.6}, {}]
    n = 100  # rows of each kind, interleaved in one batch, each with its own seed
    params = [SamplingParams(temperature=1.0, seed=r, **kinds[r % 4]) for r in range(4 * n)]
    logits = torch.tensor(BASE_PROBS).log().expand(len(params), -1).contiguous()
    out = sample(logits, params, [make_generator(p) for p in params])
    seen = [set(out[i::4]) for i in range(4)]
    assert seen == [{0}, {0, 1}, {0, 1}, {0, 1, 2, 3, 4}]  # 0.40 + 0.25 crosses 0.6 at token 1


def test_minus_inf_logits_are_never_drawn():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(5))
    logits[:, ::2] = float("-inf")  # e.g. vocabulary padding
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0, top_p=0.95, seed=2),
              SamplingParams(temperature=2.0, top_k=30, seed=3)]  # k past the finite tokens
    gens = [make_generator(p) for p in params]
    seen = set()
    for _ in range(300):
        seen.update(sample(logits, params, gens))
    assert seen and all(t % 2 == 1 for t in seen)
    assert len(seen) > 10


# ------------------------------------------------------------------ distributions
@pytest.mark.parametrize(
    "knobs",
    [
        {"temperature": 1.0},
        {"temperature": 0.5},
        {"temperature": 2.0},
        {"temperature": 1.0, "top_k": 3},
        {"temperature": 1.0, "top_p": 0.7},
        {"temperature": 0.8, "top_k": 4, "top_p": 0.8},
    ],
    ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()),
)
def test_distribution_matches_reference(knobs):
    want = _expected(BASE_PROBS, **knobs)
    got = _frequencies(_draw_seeded(SamplingParams(**knobs)), len(BASE_PROBS))
    assert max(abs(a - b) for a, b in zip(got, want)) < MAX_ABS_DIFF, (got, want)
    # the bound is tight enough to tell the knobs apart: the unfiltered T=1 distribution fails
    if knobs != {"temperature": 1.0}:
        assert max(abs(a - b) for a, b in zip(got, BASE_PROBS)) > 2 * MAX_ABS_DIFF


def test_unseeded_batch_draw_matches_reference():
    """Rows without a generator share one batch-wide draw from torch's default generator."""
    torch.manual_seed(3)
    sp = SamplingParams(temperature=0.5, top_k=4)
    logits = torch.tensor(BASE_PROBS).log().expand(N_DRAWS, -1).contiguous()
    got = _frequencies(sample(logits, [sp] * N_DRAWS, [None] * N_DRAWS), len(BASE_PROBS))
    want = _expected(BASE_PROBS, temperature=0.5, top_k=4)
    assert max(abs(a - b) for a, b in zip(got, want)) < MAX_ABS_DIFF, (got, want)


# ------------------------------------------------------------------ devices
@pytest.mark.parametrize("device", DEVICES)
def test_sampling_on_the_logits_device(device):
    torch.manual_seed(4)
    logits = torch.randn(5, 300, device=device, dtype=torch.bfloat16)
    params = [SamplingParams(), SamplingParams(temperature=0.8, seed=11, top_k=50),
              SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.2, seed=12, top_p=0.5),
              SamplingParams(temperature=0.6, seed=13, top_k=1)]
    gens = [make_generator(p, device) for p in params]
    assert all(g is None or g.device.type == device for g in gens)
    out = sample(logits, params, gens)
    assert all(isinstance(t, int) and 0 <= t < 300 for t in out)
    assert out[0] == int(logits[0].float().argmax()) and out[4] == int(logits[4].float().argmax())
    again = sample(logits, params, [make_generator(p, device) for p in params])
    assert [again[i] for i in (0, 1, 3, 4)] == [out[i] for i in (0, 1, 3, 4)]
    # a cpu generator (the old default) with logits on the device still works, seeded the same
    cpu_gens = [make_generator(p) for p in params]
    mixed = sample(logits, params, cpu_gens)
    assert mixed[0] == out[0] and 0 <= mixed[1] < 300


@pytest.mark.parametrize("device", DEVICES)
def test_distribution_on_the_device(device):
    sp = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
    got = _frequencies(_draw_seeded(sp, device=device), len(BASE_PROBS))
    want = _expected(BASE_PROBS, temperature=0.8, top_k=4, top_p=0.9)
    assert max(abs(a - b) for a, b in zip(got, want)) < MAX_ABS_DIFF, (got, want)


def test_suppress_masks_only_the_banned_ids_of_their_rows_and_copies():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    out = suppress(logits, {0: [1]})
    assert sample(out, [SamplingParams(), SamplingParams()], [None, None]) == [2, 1]
    assert logits[0, 1] == 5.0  # the caller's logits (logprobs) are untouched
    assert suppress(logits, {0: []}) is logits
