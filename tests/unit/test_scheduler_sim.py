"""Randomized simulation of the scheduler against SimRunner, a fake model that checks every
KV read (a pseudo-hit raises) and derives its tokens from what it read, so caching on vs off
must give identical outputs. The bookkeeping-level caching oracle."""

from __future__ import annotations

import random

import pytest

from llm_svc.types.request import Request, make_prompt_keys
from mmserve.testing.sched_sim import SimRunner
from llm_svc.engine.scheduler import Scheduler, SchedulerConfig
from shared.schemas import SamplingParams

pytestmark = pytest.mark.unit

VOCAB = 40
EOS = 0


def FakeModel(sched: Scheduler) -> SimRunner:
    return SimRunner(lambda rid: sched.requests[rid], sched.config.window, vocab=VOCAB)


def make_workload(rng: random.Random, n: int) -> list[tuple]:
    """(parent, new_ids, spans, hashes, max_tokens, system_len). ``parent`` None: a fresh
    conversation (a shared system prompt + a random user turn, sometimes with an image); else a
    later turn of request ``parent``: its prompt + outputs + ``new_ids`` (known once it finished)."""
    systems = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(10, 60))] for _ in range(4)]
    images = ["a" * 32, "b" * 32]
    out = []
    for i in range(n):
        spans, hashes = [], []
        if i > 4 and rng.random() < 0.35:
            parent = rng.randrange(max(0, i - 12), i)
            ids = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 20))]
            system_len = 0
        else:
            parent = None
            system = rng.choice(systems)
            system_len = len(system)
            ids = system + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 40))]
            if rng.random() < 0.3:
                s = rng.randrange(0, len(ids) - 8)
                ids[s:s + 6] = [VOCAB - 1] * 6  # same placeholder ids, key from the image hash
                spans, hashes = [(s, 6, 0)], [rng.choice(images)]
        out.append((parent, ids, spans, hashes, rng.randint(1, 24), system_len))
    return out


BASE = dict(max_batch_tokens=24, max_running=6, window=8, decode_release_interval=3)
# several prefills per step, bidirectional media spans, checkpoints, compute-aware admission
VARIANT = dict(
    max_batch_tokens=32, max_chunk_tokens=10, max_running=8, window=5, decode_release_interval=4,
    policy="compute_aware",
)


def simulate(
    cache: bool, seed: int, n_req: int = 120, abort_p: float = 0.0, full: int = 420, swa: int = 70,
    conf: dict = BASE, bidirectional: bool = False, checkpoints: bool = False,
):
    rng = random.Random(seed)
    work = make_workload(random.Random(seed + 1), n_req)
    cfg = SchedulerConfig(**conf, enable_prefix_cache=cache)
    sched = Scheduler(cfg, full, swa)
    model = FakeModel(sched)
    reqs: dict[int, Request] = {}
    nxt_i = 0
    while nxt_i < len(work) or sched.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if nxt_i == len(work):
                break
            parent, ids, spans, hashes, mt, system_len = work[nxt_i]
            if parent is not None:
                p = reqs[parent]
                if not p.is_finished:
                    break  # turns arrive in order, once the previous answer is complete
                base_ids, base_keys = p.all_ids, p.all_keys
                if len(base_ids) + len(ids) + mt > 200:
                    base_ids, base_keys = [], []
                spans = list(p.mm_spans) if base_ids else []  # same absolute positions
                keys = base_keys + ids
                ids = base_ids + ids
            else:
                keys = make_prompt_keys(ids, spans, hashes)
            r = Request(
                f"r{nxt_i}", ids, SamplingParams(max_tokens=mt), prompt_keys=keys,
                mm_spans=spans, eos_token_ids=[EOS], bidirectional=bidirectional,
                swa_checkpoints=[system_len] if checkpoints and system_len else [],
            )
            reqs[nxt_i] = r
            sched.add(r)
            nxt_i += 1
        batch = sched.schedule()
        if batch is None:
            continue
        nxt = model.run(batch)
        if abort_p and rng.random() < abort_p and sched.running:
            sched.abort(rng.choice(sched.running).req_id)  # mid-step, like a client going away
        sched.postprocess(batch, nxt)
        sched.check_integrity()
    assert all(r.is_finished for r in reqs.values())
    outputs = {r.req_id: list(r.output_ids) for r in reqs.values()}
    return sched, model, outputs, reqs


def _assert_drained(sched: Scheduler) -> None:
    u = sched.kv.usage()
    assert u["full_free"] + u["full_cached"] == u["full_total"]
    assert u["swa_free"] + u["swa_cached"] == u["swa_total"]
    assert sched.kv.tree.locked_full == 0 and sched.kv.tree.locked_swa == 0


@pytest.mark.parametrize("seed", [0, 1])
def test_cache_on_equals_cache_off_under_eviction_pressure(seed):
    on, model_on, out_on, _ = simulate(True, seed)
    off, _, out_off, _ = simulate(False, seed)
    assert out_on == out_off
    _assert_drained(on)
    _assert_drained(off)
    st = on.kv.tree.stats
    # the pools were small enough that both kinds of eviction (and preemption) happened
    assert st["swa_evictions"] > 0 and st["node_evictions"] > 0, st
    assert on.cached_tokens > 0
    assert off.cached_tokens == 0


def test_variant_chunks_bidirectional_checkpoints_compute_aware():
    kw = dict(conf=VARIANT, bidirectional=True, checkpoints=True, full=350, swa=48)
    on, _, out_on, _ = simulate(True, 3, **kw)
    off, _, out_off, _ = simulate(False, 3, **kw)
    assert out_on == out_off
    _assert_drained(on)
    st = on.kv.tree.stats
    assert st["swa_evictions"] > 0 and st["node_evictions"] > 0, st
    assert on.cached_tokens > 0 and on.num_preemptions > 0


def _run_one(sched: Scheduler, model: FakeModel, r: Request) -> Request:
    sched.add(r)
    while sched.has_unfinished():
        b = sched.schedule()
        sched.postprocess(b, model.run(b))
        sched.check_integrity()
    return r


def test_media_keys_never_share_kv_across_images():
    """Same token ids, different image hash: sharing stops at the first media token."""
    ids = list(range(1, 30))
    span = [(10, 5, 0)]
    sched = Scheduler(SchedulerConfig(max_batch_tokens=64, window=4), 400, 200)
    model = FakeModel(sched)

    def req(name, ids, keys):
        return Request(name, ids, SamplingParams(max_tokens=2, ignore_eos=True), prompt_keys=keys, mm_spans=span)

    m0 = _run_one(sched, model, req("m0", ids, make_prompt_keys(ids, span, ["x" * 32])))
    assert m0.num_cached_tokens == 0
    # diverges at 10, but m0 released the SWA there: window-safe hit is 0; m1 keeps its branch
    m1 = _run_one(sched, model, req("m1", ids, make_prompt_keys(ids, span, ["y" * 32])))
    assert m1.num_cached_tokens == 0
    m2 = _run_one(sched, model, req("m2", ids, make_prompt_keys(ids, span, ["z" * 32])))
    assert m2.num_cached_tokens == 10  # the text before the image, revived by m1
    # the next turn after m0 (same image) reuses all 30 computed positions of m0
    ids3, keys3 = m0.all_ids + [5], m0.all_keys + [5]
    m3 = _run_one(sched, model, req("m3", ids3, keys3))
    assert m3.num_cached_tokens == 30
    # same ids as that turn but another image: never m0's KV after the text before the image;
    # m1 (same image y) is a whole-prompt prefix, and its prompt-end window was kept
    keys4 = make_prompt_keys(ids3, span, ["y" * 32])
    m4 = _run_one(sched, model, req("m4", ids3, keys4))
    assert keys4[:10] == keys3[:10] and keys4[10] != keys3[10] and keys4[: len(ids)] == m1.all_keys[: len(ids)]
    assert m4.num_cached_tokens == len(ids)


def test_random_aborts_and_preemptions_never_leak():
    sched, model, _, reqs = simulate(True, 7, n_req=80, abort_p=0.15, full=300, swa=60)
    _assert_drained(sched)
    assert any(r.finish_reason == "abort" for r in reqs.values())
    assert model.tokens_read > 0
