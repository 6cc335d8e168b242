"""The draft-length policies on their own: the cost model fits a step's time, the goodput policy
drafts when drafts are cheap and accepted and stops when they are not, vLLM's batch-size table
means what it means there, and the config refuses a malformed table."""

from __future__ import annotations

import random

import pytest

from llm_svc.engine.spec import SpeculativeConfig
from llm_svc.engine.spec.policy import (Acceptance, Candidate, FixedDrafts, GoodputDrafts, StepCost, TableDrafts,
                                        make_policy)


def test_step_cost_fits_a_linear_step():
    cost, rng = StepCost(), random.Random(0)
    for _ in range(300):
        t = rng.randrange(1, 400)
        cost.observe(t, 0.004 + 0.0002 * t)
    a, b = cost.coefficients()
    assert a == pytest.approx(0.004, rel=0.05) and b == pytest.approx(0.0002, rel=0.05) and cost.err < 0.02


def test_step_cost_forgets_an_old_machine():
    """After the step's cost changes (another load on the machine), the fit follows the new one."""
    cost, rng = StepCost(), random.Random(2)
    for _ in range(300):
        t = rng.randrange(1, 400)
        cost.observe(t, 0.004 + 0.0002 * t)
    for _ in range(3000):
        t = rng.randrange(1, 400)
        cost.observe(t, 0.008 + 0.0004 * t)
    a, b = cost.coefficients()
    assert a == pytest.approx(0.008, rel=0.05) and b == pytest.approx(0.0004, rel=0.05)


def _trained(a: float, b: float, m0: float = 0.0, m1: float = 0.0, mtp: bool = False) -> GoodputDrafts:
    """A policy whose fits have seen steps of ``a + b T`` and MTP layers of ``m0 + m1 rows`` each."""
    pol = GoodputDrafts(3, mtp)
    rng = random.Random(1)
    for _ in range(200):
        t, r = rng.randrange(1, 300), rng.randrange(1, 300)
        pol.cost.observe(t, a + b * t)
        pol.mtp_cost.observe(r, 3, 3 * (m0 + m1 * r))
    return pol


def test_goodput_drafts_when_they_pay_and_not_when_they_do_not():
    cands = [Candidate(f"r{i}", 3, [0.9, 0.8, 0.7]) for i in range(4)]
    cheap = _trained(0.02, 0.0001)  # a step's fixed cost dominates: every accepted draft is nearly free
    assert cheap.choose(cands, 4, 0) == {c.req_id: 3 for c in cands}
    dear = _trained(0.001, 0.01)  # each token costs as much as a step: drafts never pay
    assert dear.choose(cands, 4, 0) == {c.req_id: 0 for c in cands}
    poor = [Candidate("x", 3, [0.05, 0.05, 0.05]), Candidate("y", 3, [0.95, 0.9, 0.9])]
    mid = _trained(0.004, 0.001)
    ks = mid.choose(poor, 2, 0)
    assert ks["x"] == 0 and ks["y"] >= 2  # each request by its own acceptance
    assert cheap.choose([Candidate("z", 1, [0.9, 0.9, 0.9])], 1, 0) == {"z": 1}  # never past room


def test_mtp_runs_as_many_layers_as_its_longest_draft():
    pol = _trained(0.004, 0.0002, 0.002, 0.0002, mtp=True)  # each MTP layer costs about half a step
    assert pol.bounds() == [0, 1, 2, 3]
    assert pol.mtp_cost.predict(16, 3) == pytest.approx(3 * (0.002 + 0.0002 * 16), rel=0.05)
    ks = pol.choose([Candidate(f"r{i}", 3, [0.5, 0.3, 0.2]) for i in range(16)], 16, 16)
    assert set(ks.values()) == {0} and pol.layers(ks) == 0
    cheap = _trained(0.02, 0.0001, 0.0001, 0.00001, mtp=True)
    ks = cheap.choose([Candidate("a", 3, [0.9, 0.9, 0.9])], 1, 1)
    assert ks == {"a": 3} and cheap.layers(ks) == 3
    # the third layer's drafts are rarely accepted: two layers, not three
    ks = cheap.choose([Candidate(f"r{i}", 3, [0.95, 0.9, 0.01]) for i in range(4)], 4, 4)
    assert set(ks.values()) == {2} and cheap.layers(ks) == 2


def test_prompt_rows_get_the_layers_their_decodes_will_draft_with():
    """A step of prompt chunks only (nobody drafts yet) runs the MTP layers the policy plans for
    the decodes those requests become: none for a burst too large to draft, all at one request,
    all while the fits learn; planning counts nothing (no histogram, no step)."""
    pol = _trained(0.004, 0.0002, 0.002, 0.0002, mtp=True)
    burst = [Candidate(f"r{i}", 3, [0.5, 0.3, 0.2]) for i in range(16)]
    before = (dict(pol.chosen), pol._steps)
    assert pol.planned_layers(burst, 16, 16) == 0
    assert pol.planned_layers([], 0, 0) == 0
    assert (dict(pol.chosen), pol._steps) == before
    cheap = _trained(0.02, 0.0001, 0.0001, 0.00001, mtp=True)
    assert cheap.planned_layers([Candidate("a", 3, [0.9, 0.9, 0.9])], 1, 1) == 3
    assert cheap.planned_layers([Candidate("a", 2, [0.9, 0.9, 0.9])], 1, 1) == 2  # its room
    assert GoodputDrafts(3, True).planned_layers(burst, 16, 16) == 3  # learning: all of them
    table = TableDrafts(3, [(1, 4, 3), (5, 16, 1)])
    assert table.planned_layers(burst[:2], 2, 2) == 3 and table.planned_layers(burst, 16, 16) == 1
    assert table.planned_layers(burst + burst, 32, 32) == 0


def test_every_policy_keeps_a_step_within_its_draft_budget():
    """16 decodes that could each draft 3 under a budget of 32 draft tokens: never more than 32
    in all; the fixed policy shares it evenly (2 each, as the scheduler would), the goodput one
    gives it to the likeliest drafts and, with MTP, runs only the layers those drafts need."""
    cands = [Candidate(f"r{i}", 3, [0.95, 0.9, 0.85] if i < 4 else [0.9, 0.6, 0.3]) for i in range(16)]
    fixed = make_policy(SpeculativeConfig("ngram", 3, draft_policy="fixed"), mtp=False, budget=32)
    assert fixed.choose(cands, 16, 0) == {c.req_id: 2 for c in cands}
    assert fixed.choose(cands[:8], 8, 0) == {c.req_id: 3 for c in cands[:8]}  # 24 fit: no cut
    pol = GoodputDrafts(3, True, budget=32)
    rng = random.Random(1)
    for _ in range(200):
        t, r = rng.randrange(1, 300), rng.randrange(1, 300)
        pol.cost.observe(t, 0.02 + 0.0001 * t)
        pol.mtp_cost.observe(r, 3, 3 * (0.0001 + 0.00001 * r))
    ks = pol.choose(cands, 16, 16)
    assert sum(ks.values()) <= 32 and all(ks[f"r{i}"] == 3 for i in range(4))
    assert pol.layers(ks) == 3
    unbounded = GoodputDrafts(3, True)
    unbounded.cost, unbounded.mtp_cost = pol.cost, pol.mtp_cost
    assert sum(unbounded.choose(cands, 16, 16).values()) > 32
    warming = GoodputDrafts(3, True, budget=32)  # before its fits learn: the most the budget takes
    assert warming.choose(cands, 16, 16) == {c.req_id: 2 for c in cands}


def test_acceptance_is_per_position_given_the_earlier_ones():
    acc = Acceptance(3, decay=0.5, prior=0.5)
    acc.observe("r", 3, 1)  # draft 0 accepted, draft 1 rejected, draft 2 not seen
    assert acc.of("r") == [0.75, 0.25, 0.5]
    assert acc.of("other") == acc.overall and acc.overall[2] == 0.5
    acc.drop("r")
    assert acc.of("r") == acc.overall


def test_vllm_batch_size_table():
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4,
                                 "num_speculative_tokens_per_batch_size": [[5, 16, 1], [1, 4, 4]]})
    pol = make_policy(c, mtp=False)
    assert isinstance(pol, TableDrafts) and pol.table == [(1, 4, 4), (5, 16, 1)]
    assert [pol.k_for(b) for b in (1, 4, 5, 16, 17)] == [4, 4, 1, 1, 0]
    cands = [Candidate(f"r{i}", 2, [0.9] * 4) for i in range(3)]
    assert pol.choose(cands, 3, 0) == {c.req_id: 2 for c in cands}  # k 4 for 3 requests, capped by room
    assert isinstance(make_policy(SpeculativeConfig("ngram", 3), False), GoodputDrafts)
    assert isinstance(make_policy(SpeculativeConfig("ngram", 3, draft_policy="fixed"), False), FixedDrafts)
    for bad in ([[4, 2, 1]], [[1, 4, 2], [3, 8, 1]], [], [[1, 2]]):
        with pytest.raises(ValueError, match="num_speculative_tokens_per_batch_size"):
            SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2,
                                     "num_speculative_tokens_per_batch_size": bad})
    with pytest.raises(ValueError, match="draft_policy"):
        SpeculativeConfig("ngram", 2, draft_policy="fast")
