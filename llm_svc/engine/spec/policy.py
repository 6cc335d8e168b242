"""How many drafts each decode sends next step: the draft-length policies.

Every policy keeps a step's drafts within its budget (``max_draft_tokens``: draft tokens one
step verifies; None: no bound), which the scheduler also enforces (an even share when a step's
drafts exceed it).

* ``FixedDrafts``: always the configured ``k``, cut to an even share of the budget.
* ``TableDrafts``: vLLM's ``num_speculative_tokens_per_batch_size``: ``[(first, last, k), ...]``,
  inclusive batch-size ranges -> k for every decode of a batch of that size (0 outside them).
* ``GoodputDrafts`` (``"draft_policy": "auto"``, the default): k per request, chosen for the
  expected tokens per second of the next step (SmartSpec / TurboSpec's goodput). Two measured
  inputs:

  - **the step's cost**: ``a + b T`` for the step less its MTP layers (``T``: the forward's query
    tokens), and ``L (m0 + m1 R)`` for the MTP layers (``L`` layers over ``R`` rows, timed around
    their own call), each fitted online by recursive least squares with forgetting over every
    step (``StepCost``, ``MTPCost``): they follow the machine, the model and the load;
  - **each request's acceptance per draft position** (``Acceptance``): the probability that draft
    j is accepted given drafts < j were, an exponentially decayed average per request, started
    from the running average over all requests.

  Draft j of request i yields ``p_ij`` = the product of its first j acceptances tokens and costs
  ``b``; with MTP, drafts up to L per request cost L layers' run. The drafts are taken in
  decreasing ``p_ij`` while the step's expected tokens per expected second still grows and the
  budget lasts, for each bound L on the drafts per request, and the best L wins (MTP then runs L
  of its layers: a layer left out leaves its KV of those rows unwritten, which lowers its later
  drafts' acceptance for a window, never the output). k = 0 for everyone when no draft pays.
  The first steps use the configured k while the fits learn.

No policy changes which tokens come out: every draft is verified by the target model (greedy
output and the sampled distribution are the same for any sequence of k)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Candidate:
    """A decode that may draft next step: at most ``room`` drafts; ``accept[j]``: P(draft j
    accepted | drafts < j accepted)."""

    req_id: str
    room: int
    accept: list[float]


class StepCost:
    """``seconds ~ a + b T`` (``T``: the step's query tokens) by recursive least squares with
    forgetting ``lam`` (``T`` scaled to hundreds of tokens so the fit is well conditioned). The
    MTP layers' time is fitted apart (``MTPCost``): the engine subtracts it before observing."""

    # forgetting 0.998 (a memory of ~500 steps): the prefill chunks seen go on telling the per-token
    # cost apart from the fixed one while only decodes run (their T barely varies at one request)
    def __init__(self, lam: float = 0.998, prior: tuple[float, float] = (0.005, 0.0002)):
        self.lam = lam
        self.theta = np.array([prior[0], prior[1] * 100])
        self.p = np.eye(2) * 10.0
        self.n = 0
        self.err = 0.0  # decayed mean |predicted - measured| / measured

    @staticmethod
    def _x(tokens: int) -> np.ndarray:
        return np.array([1.0, tokens / 100.0])

    def predict(self, tokens: int) -> float:
        a, b = self.coefficients()
        return a + b * tokens

    def coefficients(self) -> tuple[float, float]:
        """``(a, b)`` in seconds and seconds per token; never negative (a negative fit says
        "free", which the policy must not believe)."""
        a, b = self.theta
        return max(float(a), 0.0), max(float(b), 0.0) / 100.0

    def observe(self, tokens: int, seconds: float) -> None:
        if seconds <= 0 or tokens < 0:
            return
        pred = self.predict(tokens)
        self.err = 0.95 * self.err + 0.05 * abs(pred - seconds) / seconds if self.n else abs(pred - seconds) / seconds
        x = self._x(tokens)
        px = self.p @ x
        gain = px / (self.lam + x @ px)
        self.theta = self.theta + gain * (seconds - x @ self.theta)
        self.p = (self.p - np.outer(gain, px)) / self.lam
        self.n += 1


class MTPCost:
    """The MTP layers' own time per layer run, ``m0 + m1 rows`` (timed around their step, so it
    needs no step without them to be told apart from the LM's): least squares with forgetting."""

    def __init__(self, lam: float = 0.99):
        self.fit = StepCost(lam, prior=(0.001, 0.00005))

    @property
    def n(self) -> int:
        return self.fit.n

    def predict(self, rows: int, layers: int) -> float:
        return layers * self.fit.predict(rows) if layers else 0.0

    def observe(self, rows: int, layers: int, seconds: float) -> None:
        if layers:
            self.fit.observe(rows, seconds / layers)


class Acceptance:
    """Per-position acceptance, all requests together and per request (decayed averages)."""

    def __init__(self, k: int, decay: float = 0.7, prior: float = 0.6):
        self.k, self.decay = k, decay
        self.overall = [prior] * k
        self.per_req: dict[str, list[float]] = {}

    def of(self, req_id: str) -> list[float]:
        return self.per_req.get(req_id) or list(self.overall)

    def observe(self, req_id: str, drafted: int, accepted: int) -> None:
        """A verified step: ``drafted`` drafts sent, the first ``accepted`` kept. Position j is
        seen when every draft before it was accepted."""
        mine = self.per_req.setdefault(req_id, list(self.overall))
        for j in range(min(drafted, accepted + 1, self.k)):
            hit = 1.0 if j < accepted else 0.0
            mine[j] = self.decay * mine[j] + (1 - self.decay) * hit
            self.overall[j] = 0.98 * self.overall[j] + 0.02 * hit

    def drop(self, req_id: str) -> None:
        self.per_req.pop(req_id, None)


def share(budget: int | None, n: int) -> int | None:
    """An even share of a step's draft budget over ``n`` decodes (at least one each)."""
    return None if budget is None or n < 1 else max(1, budget // n)


class FixedDrafts:
    name = "fixed"

    def __init__(self, k: int, budget: int | None = None):
        self.k, self.budget = k, budget
        self.chosen: Counter = Counter()  # (batch size, k) -> steps

    def k_for(self, batch: int) -> int:
        return self.k

    def choose(self, cands: list[Candidate], base_tokens: int, mtp_rows: int) -> dict[str, int]:
        out = self._plan(cands)
        self.chosen[(len(cands), max(out.values(), default=0))] += 1
        return out

    def planned_layers(self, cands: list[Candidate], base_tokens: int, mtp_rows: int) -> int:
        """The drafts per request (MTP layers) a step of decodes ``cands`` would get, nothing counted."""
        return max(self._plan(cands).values(), default=0)

    def _plan(self, cands: list[Candidate]) -> dict[str, int]:
        k = min(self.k, self.k_for(len(cands)))
        cap = share(self.budget, len(cands))
        if cap is not None and k * len(cands) > self.budget:
            k = min(k, cap)
        return {c.req_id: min(k, c.room) for c in cands}


class TableDrafts(FixedDrafts):
    """vLLM's ``num_speculative_tokens_per_batch_size``."""

    name = "table"

    def __init__(self, k: int, table: list[tuple[int, int, int]], budget: int | None = None):
        super().__init__(k, budget)
        self.table = table

    def k_for(self, batch: int) -> int:
        return next((k for lo, hi, k in self.table if lo <= batch <= hi), 0)


@dataclass
class GoodputDrafts:
    """See the module doc. ``mtp``: drafts come from MTP layers (their rows cost ``c`` each)."""

    k: int
    mtp: bool
    budget: int | None = None  # draft tokens one step verifies (None: no bound)
    warmup_steps: int = 30
    cost: StepCost = field(default_factory=StepCost)  # the step less its MTP layers: a + b T
    mtp_cost: MTPCost = field(default_factory=MTPCost)
    chosen: Counter = field(default_factory=Counter)
    name: str = "auto"

    def __post_init__(self) -> None:
        self._steps = 0
        self.last_prediction: float | None = None

    def choose(self, cands: list[Candidate], base_tokens: int, mtp_rows: int) -> dict[str, int]:
        """``base_tokens``: the next step's query tokens without drafts (its decodes' inputs and
        prefill chunks, as this step's); ``mtp_rows``: rows each MTP layer runs over."""
        self._steps += 1
        if not cands:
            return {}
        out = self._plan(cands, base_tokens, mtp_rows)
        drafts = sum(out.values())
        layers = self.layers(out)
        self.last_prediction = self.cost.predict(base_tokens + drafts) + self.mtp_cost.predict(mtp_rows, layers)
        self.chosen[(len(cands), max(out.values(), default=0))] += 1
        return out

    def planned_layers(self, cands: list[Candidate], base_tokens: int, mtp_rows: int) -> int:
        """The MTP layers a step of decodes ``cands`` would run (all of them while the fits learn),
        nothing counted."""
        return max(self._plan(cands, base_tokens, mtp_rows).values(), default=0)

    def _plan(self, cands: list[Candidate], base_tokens: int, mtp_rows: int) -> dict[str, int]:
        """``choose``'s drafts per request, nothing counted."""
        if self.cost.n < self.warmup_steps:  # the fits learn: the most drafts the budget takes
            cap = share(self.budget, len(cands))
            warm = min(self.k, cap) if cap is not None and self.k * len(cands) > self.budget else self.k
            return {c.req_id: min(warm, c.room) for c in cands}
        return self._best(cands, base_tokens, mtp_rows)[1][1]

    def bounds(self) -> list[int]:
        """The bounds on drafts per request tried (with MTP: the layers run)."""
        return list(range(self.k + 1))

    def layers(self, ks: dict[str, int]) -> int:
        """MTP layers a step with drafts ``ks`` runs: as many as its longest draft (0 without MTP)."""
        return max(ks.values(), default=0) if self.mtp else 0

    def _best(self, cands, base_tokens: int, mtp_rows: int):
        best_l, best, best_g = 0, None, -1.0
        for bound in self.bounds():
            g, ks = self._fill(cands, base_tokens, mtp_rows, bound)
            if g > best_g:
                best_l, best, best_g = bound, (bound, ks), g
        return best_l, best

    def _fill(self, cands: list[Candidate], base_tokens: int, mtp_rows: int, bound: int) -> tuple[float, dict]:
        """The greedy fill under ``bound`` drafts per request: (expected tokens / second, k per request)."""
        a, b = self.cost.coefficients()
        fixed = a + b * base_tokens + (self.mtp_cost.predict(mtp_rows, bound) if self.mtp else 0.0)
        gains = []
        for cd in cands:
            p = 1.0
            for j in range(min(bound, cd.room, len(cd.accept))):
                p *= cd.accept[j]
                gains.append((p, cd.req_id))
        gains.sort(key=lambda x: -x[0])
        tokens, seconds = float(len(cands)), max(fixed, 1e-6)
        ks = {cd.req_id: 0 for cd in cands}
        best = tokens / seconds
        budget = len(gains) if self.budget is None else self.budget
        for p, rid in gains[:budget]:
            t, s = tokens + p, seconds + b
            if t / s <= best:
                break
            tokens, seconds, best = t, s, t / s
            ks[rid] += 1
        if bound and max(ks.values(), default=0) < bound:
            return -1.0, ks  # a smaller bound gives these drafts without its unused layers
        return best, ks


def make_policy(config, mtp: bool, budget: int | None = None):
    """The policy a ``SpeculativeConfig`` names (``budget``: draft tokens one step verifies)."""
    k = config.num_speculative_tokens
    if config.num_speculative_tokens_per_batch_size:
        return TableDrafts(k, [tuple(x) for x in config.num_speculative_tokens_per_batch_size], budget)
    if config.draft_policy == "fixed":
        return FixedDrafts(k, budget)
    return GoodputDrafts(k, mtp, budget)
