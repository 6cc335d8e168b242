"""Our n-gram proposer vs vLLM 0.32's (``vllm.v1.spec_decode.ngram_proposer.NgramProposer``) on
the same contexts: the same drafts, for random and repetitive contexts, every n-gram bound
setting, k, and contexts at and near ``max_model_len``.

vLLM's proposer runs in its venv (a subprocess reading the cases as JSON on stdin): its own
``propose`` (the skip at ``max_model_len``), ``batch_propose`` and the numba kernel, on an
instance made without a ``VllmConfig`` (which needs a model) by setting the attributes its
``__init__`` would set from one."""

from __future__ import annotations

import json
import random
import subprocess

import numpy as np
import pytest

from llm_svc.engine.spec import NgramProposer
from tests.integration.test_vllm_oracle import vllm_python  # noqa: F401  (the venv fixture)

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

VLLM_SIDE = r"""
import json, sys
import numpy as np
from vllm.v1.spec_decode.ngram_proposer import NgramProposer

out = []
for g in json.load(sys.stdin):
    ctxs, mml, k = g["contexts"], g["max_model_len"], g["k"]
    p = NgramProposer.__new__(NgramProposer)  # __init__'s attributes, without a VllmConfig
    p.min_n, p.max_n, p.k, p.max_model_len = g["min_n"], g["max_n"], k, mml
    p.valid_ngram_draft = np.zeros((len(ctxs), k), dtype=np.int32)
    p.valid_ngram_num_drafts = np.zeros(len(ctxs), dtype=np.int32)
    p.num_tokens_threshold, p.num_numba_thread_available = 8192, 1
    token_ids = np.zeros((len(ctxs), mml), dtype=np.int32)
    for i, c in enumerate(ctxs):
        token_ids[i, :len(c)] = c
    num_tokens = np.array([len(c) for c in ctxs], dtype=np.int32)
    # every request sampled a token last step (a non-empty list): all may be drafted for
    out.append(p.propose(g["num_speculative_tokens"], [[0]] * len(ctxs), num_tokens, token_ids))
json.dump(out, sys.stdout)
"""

SETTINGS = [(1, 1), (1, 3), (2, 4), (3, 3), (5, 5), (1, 8), (2, 16)]


def _contexts(rng: random.Random, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        length = rng.choice([rng.randint(1, 12), rng.randint(1, 200), rng.randint(200, 1500)])
        kind = i % 3
        if kind == 0:  # random ids over a small vocabulary
            v = rng.randint(1, 8)
            out.append([rng.randrange(v) for _ in range(length)])
        elif kind == 1:  # random ids over a large one: few matches
            out.append([rng.randrange(50_000) for _ in range(length)])
        else:  # copies of earlier spans with edits (code edits, quoted tool output)
            c = [rng.randrange(1000) for _ in range(rng.randint(1, 30))]
            while len(c) < length:
                a = rng.randrange(len(c))
                c += [t if rng.random() > 0.05 else rng.randrange(1000) for t in c[a:a + rng.randint(2, 40)]]
            out.append(c[:length])
    return out


def _cases() -> list[dict]:
    rng = random.Random(23)
    groups = []
    for lo, hi in SETTINGS:
        for k in (1, 3, 5):
            ctxs = _contexts(rng, 60)
            # max_model_len 2048: room for every draft; then one where each context sits at, or
            # just under, the limit (drafts capped, or none at all)
            groups.append({"min_n": lo, "max_n": hi, "k": k, "num_speculative_tokens": k,
                           "max_model_len": 2048, "contexts": ctxs})
            short = [c for c in ctxs if len(c) >= 3][:20]
            mml = max(len(c) for c in short) if short else 8
            near = [c[:mml - rng.randint(0, 3)] for c in short] + [c + [c[0]] * (mml - len(c)) for c in short[:5]]
            groups.append({"min_n": lo, "max_n": hi, "k": k, "num_speculative_tokens": k,
                           "max_model_len": mml, "contexts": near})
            # vLLM's per-step num_speculative_tokens below k: our max_new
            groups.append({"min_n": lo, "max_n": hi, "k": k, "num_speculative_tokens": max(1, k - 2),
                           "max_model_len": 2048, "contexts": ctxs[:20]})
    return groups


def test_ngram_proposals_equal_vllms(vllm_python):  # noqa: F811
    cases = _cases()
    proc = subprocess.run([vllm_python, "-c", VLLM_SIDE], input=json.dumps(cases), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(theirs) == len(cases)
    n_compared = n_drafted = 0
    for g, want in zip(cases, theirs):
        ours = NgramProposer(g["min_n"], g["max_n"], g["k"], max_model_len=g["max_model_len"])
        for ctx, w in zip(g["contexts"], want):
            got = ours.propose(np.array(ctx, dtype=np.int64), max_new=g["num_speculative_tokens"])
            assert got == w, {k: v for k, v in g.items() if k != "contexts"} | {"context": ctx}
            n_compared += 1
            n_drafted += bool(w)
    # the corpus must exercise both outcomes, or the comparison says little
    assert n_compared > 2000 and 0.3 * n_compared < n_drafted < 0.95 * n_compared, (n_compared, n_drafted)
