"""Adopting a hand-over on a decode engine under pressure: eviction to the host tier copies the
evicted KV down before the hand-over overwrites its slots, an adopted prefix stays locked until its
request is admitted, an abort before admission leaks nothing, and an engine without a prefix cache
recomputes. Tiny random-weight MiMo, W = 16."""

from __future__ import annotations

import pytest

from llm_svc.disagg.decode import DecodeSide
from llm_svc.disagg.prefill import PrefillConfig, PrefillSide, kv_fingerprint
from llm_svc.engine.engine import Engine
from llm_svc.engine.model_runner import ModelRunner
from llm_svc.engine.scheduler import Scheduler, SchedulerConfig
from llm_svc.models import build_model
from llm_svc.types.request import PreparedRequest
from tests.disagg_engines import (PAGE, W, assert_clean, drain, make_engine, preps, prefill_all, recording_step,
                                  request, unified)

pytestmark = pytest.mark.integration


def test_adoption_that_evicts_to_the_host_tier_keeps_every_cached_prefix_right(mimo16):
    """A decode engine whose pools are full of other prompts' KV: adopting a hand-over evicts some
    of it to the host tier, and the demotions copy it down before the hand-over overwrites those
    slots (a returning prompt loaded back from the host still gives the unified engine's tokens)."""
    from llm_svc.offload.host_kv import HostKV
    from llm_svc.offload.tiers import KVTiers

    lm = mimo16
    first, second = preps(lm, seed=3), preps(lm, seed=4)
    second = [PreparedRequest(request_id=f"b{i}", prompt_ids=p.prompt_ids, sampling=p.sampling)
              for i, p in enumerate(second)]
    want = unified(lm, first + second)
    _, _, handovers = prefill_all(lm, second)
    cfg = SchedulerConfig(window=W, max_batch_tokens=48, max_running=6)
    num_full, num_swa = 200, cfg.min_swa_slots() + 40
    model = build_model(lm.arch, lm.model)
    runner = ModelRunner(model, num_full, num_swa)
    sched = Scheduler(cfg, num_full, num_swa, num_host_full=2000, num_host_swa=400)
    tiers = KVTiers(sched.kv, HostKV(runner.kv, [s.kind for s in model.layers], 2000, 400), None)
    e = Engine(runner, sched, lm.eos_token_ids, tiers=tiers)
    for p in first:
        e.add(request(e, p))
    got = drain(e)
    side = DecodeSide(e, kv_fingerprint(e))
    by_id = {p.request_id: p for p in second}
    assert all(side.add(request(e, by_id[h.request_id]), h) for h in handovers)
    got.update(drain(e, side.step))
    assert e.stats()["tree_demoted_full"] > 0  # adoption (and the decodes) pushed the first prompts down
    again = [PreparedRequest(request_id=f"{p.request_id}-again", prompt_ids=p.prompt_ids, sampling=p.sampling)
             for p in first]
    for p in again:
        e.add(request(e, p))
    got.update(drain(e, side.step))
    assert e.stats()["tree_loaded_full"] > 0  # some came back from the host tier
    for h in handovers:
        assert [h.first_token] + got[h.request_id] == want[h.request_id]
    for p in first:
        assert got[p.request_id] == got[f"{p.request_id}-again"] == want[p.request_id]
    assert_clean(e, sides=(side,))


def test_an_adopted_prefix_is_not_evicted_before_its_request_is_admitted(mimo16):
    """Eviction between the adoption and the request's admission (pools under pressure) cannot
    take the adopted KV: it stays locked until the request holds it, then is released."""
    lm = mimo16
    reqs = preps(lm, seed=7)[:1]
    want = unified(lm, reqs)
    pe, _, handovers = prefill_all(lm, reqs)
    e = make_engine(lm)
    side = DecodeSide(e, kv_fingerprint(e))
    assert side.add(request(e, reqs[0]), handovers[0])
    kv = e.scheduler.kv
    n = len(reqs[0].prompt_ids)
    assert side.num_held == 1 and kv.tree.full_tokens == n
    kv.tree.evict(kv.full_pool.num_slots, kv.swa_pool.num_slots)  # everything evictable goes
    assert kv.tree.full_tokens == n  # but not the adopted prompt
    step, cached = recording_step(side)
    got = drain(e, step)
    assert [handovers[0].first_token] + got["r0"] == want["r0"] and cached["r0"] == n
    assert_clean(pe, e, sides=(side,))


def test_an_adopted_request_aborted_before_admission_leaks_nothing(mimo16):
    lm = mimo16
    reqs = preps(lm, seed=8)[:1]
    pe, _, handovers = prefill_all(lm, reqs)
    e = make_engine(lm)
    side = DecodeSide(e, kv_fingerprint(e))
    assert side.add(request(e, reqs[0]), handovers[0])
    e.abort("r0")
    outs = side.step()
    assert [(t.request_id, t.finish_reason) for t in outs] == [("r0", "abort")]
    assert_clean(pe, e, sides=(side,))
    assert e.scheduler.kv.tree.evictable_full() == len(reqs[0].prompt_ids)  # the adopted KV is plain cache now


def test_a_decode_engine_without_prefix_cache_recomputes_and_a_prefill_engine_serves_its_own_requests(mimo16):
    lm = mimo16
    reqs = preps(lm, seed=11)
    want = unified(lm, reqs)
    pe = make_engine(lm)
    side = PrefillSide(pe, PrefillConfig(PAGE, kv_fingerprint(pe)))
    side.add(request(pe, reqs[0]))
    for p in reqs[1:]:  # a "both" replica: requests served here beside the ones handed over
        pe.add(request(pe, p))
    handovers, own = [], {}
    while side.has_work():
        got = side.step()
        handovers += got.handovers
        for t in got.outputs:
            own.setdefault(t.request_id, []).append(t.token_id)
    assert [h.request_id for h in handovers] == ["r0"]
    assert own == {p.request_id: want[p.request_id] for p in reqs[1:]}
    model = build_model(lm.arch, lm.model)
    cfg = SchedulerConfig(window=W, max_batch_tokens=48, max_running=6, enable_prefix_cache=False)
    num_swa = cfg.min_swa_slots() + 40
    de = Engine(ModelRunner(model, 700, num_swa), Scheduler(cfg, 700, num_swa), lm.eos_token_ids)
    dside = DecodeSide(de, kv_fingerprint(de))
    assert not dside.add(request(de, reqs[0]), handovers[0])
    assert dside.fallbacks == {"no_prefix_cache": 1}
    got = drain(de, dside.step)
    assert [handovers[0].first_token] + got["r0"] == want["r0"]
    assert_clean(pe, sides=(dside,))
    de.scheduler.check_integrity()
