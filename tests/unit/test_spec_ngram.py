"""N-gram prompt lookup (``llm_svc.engine.spec.NgramProposer``): hand cases for vLLM 0.32's rules (the
longest n-gram wins, its earliest occurrence, k / max_new / max_model_len caps, min_n as a
floor) and a randomized comparison with a slow reference written from those rules."""

from __future__ import annotations

import random

import numpy as np
import pytest

from llm_svc.engine.spec import NgramProposer

pytestmark = pytest.mark.unit


def reference(tokens: list[int], min_n: int, max_n: int, k: int, max_new: int | None = None,
              max_model_len: int | None = None) -> list[int]:
    """The rules, spelled out: the longest n in [1, max_n] whose suffix n-gram occurs earlier
    (ending before the last token), its earliest occurrence, the k tokens after it."""
    N = len(tokens)
    if max_new is not None:
        k = min(k, max_new)
    if max_model_len is not None:
        k = min(k, max_model_len - N)
    if N < min_n or k <= 0:
        return []
    for n in range(min(max_n, N - 1), 0, -1):
        for s in range(0, N - n):
            if tokens[s:s + n] == tokens[N - n:]:
                return tokens[s + n:s + n + k] if n >= min_n else []
    return []


def test_no_match_gives_no_drafts():
    assert NgramProposer(1, 3, 4).propose([1, 2, 3, 4]) == []
    assert NgramProposer(1, 3, 4).propose(np.array([9, 8, 7], dtype=np.int32)) == []


def test_longest_ngram_wins_over_an_earlier_shorter_one():
    # [7, 8] first occurs at 0 (then 10); [6, 7, 8] only at 3 (then 20): n = 3 wins
    ctx = [7, 8, 10, 6, 7, 8, 20, 21, 6, 7, 8]
    assert NgramProposer(1, 3, 2).propose(ctx) == [20, 21]
    # with max_n = 2 the 3-gram is out of reach: the earliest [7, 8]
    assert NgramProposer(1, 2, 2).propose(ctx) == [10, 6]


def test_earliest_occurrence_of_the_longest_ngram():
    ctx = [1, 2, 3, 1, 2, 4, 1, 2]
    assert NgramProposer(2, 2, 1).propose(ctx) == [3]  # not the later [1, 2] -> 4
    assert NgramProposer(1, 5, 3).propose(ctx) == [3, 1, 2]


def test_occurrence_may_overlap_the_suffix():
    assert NgramProposer(1, 3, 4).propose([5, 5, 5, 5]) == [5]
    assert NgramProposer(1, 8, 4).propose([1, 2, 1, 2, 1, 2]) == [1, 2]  # [1, 2, 1, 2] at 0


def test_min_n_is_a_floor_not_a_fallback():
    ctx = [4, 1, 2, 9, 1, 2]  # the longest match is [1, 2]
    assert NgramProposer(2, 4, 3).propose(ctx) == [9, 1, 2]
    assert NgramProposer(3, 4, 3).propose(ctx) == []


def test_caps_on_the_number_of_drafts():
    ctx = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    p = NgramProposer(2, 2, 4)
    assert p.propose(ctx) == [3, 4, 5, 6]
    assert p.propose(ctx, max_new=2) == [3, 4]
    assert p.propose(ctx, max_new=0) == []
    assert p.propose(ctx, max_new=9) == [3, 4, 5, 6]  # max_new never raises k
    assert NgramProposer(2, 2, 4, max_model_len=11).propose(ctx) == [3, 4]
    assert NgramProposer(2, 2, 4, max_model_len=9).propose(ctx) == []  # already at max_model_len
    assert NgramProposer(2, 2, 9).propose(ctx) == [3, 4, 5, 6, 7, 1, 2]  # the context ends first


def test_short_contexts():
    p = NgramProposer(1, 3, 2)
    assert p.propose([]) == []
    assert p.propose([3]) == []
    assert p.propose([3, 3]) == [3]
    assert NgramProposer(3, 3, 2).propose([3, 3]) == []  # shorter than min_n


def test_bounds_are_checked():
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(0, 3, 2)
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(4, 3, 2)
    with pytest.raises(ValueError, match="k"):
        NgramProposer(1, 3, 0)


def _random_context(rng: random.Random) -> list[int]:
    n = rng.randint(0, 120)
    kind = rng.random()
    if kind < 0.4:  # small vocabularies: many matches of every length
        v = rng.randint(1, 6)
        return [rng.randrange(v) for _ in range(n)]
    # copies of earlier spans with a few edits, as in code edits or quoted tool output
    out = [rng.randrange(50) for _ in range(rng.randint(1, 20))]
    while len(out) < n:
        a = rng.randrange(len(out))
        span = out[a:a + rng.randint(1, 12)]
        out += [t if rng.random() > 0.1 else rng.randrange(50) for t in span]
    return out[:n]


def test_randomized_against_the_reference():
    rng = random.Random(1234)
    for _ in range(3000):
        ctx = _random_context(rng)
        lo = rng.randint(1, 4)
        hi = rng.randint(lo, 8)
        k = rng.randint(1, 6)
        max_new = rng.choice([None, rng.randint(0, 7)])
        mml = rng.choice([None, len(ctx) + rng.randint(0, 4)])
        want = reference(ctx, lo, hi, k, max_new, mml)
        got = NgramProposer(lo, hi, k, max_model_len=mml).propose(np.array(ctx, dtype=np.int64), max_new=max_new)
        assert got == want, (ctx, lo, hi, k, max_new, mml)
