"""Scheduler behaviour on small hand-made workloads: chunking, admission, preemption, abort."""

from __future__ import annotations

import pytest

from llm_svc.types.request import Request
from llm_svc.engine.sched_policy import ComputeAwarePolicy, FCFSPolicy
from mmserve.testing.sched_sim import SimRunner
from llm_svc.engine.scheduler import Scheduler, SchedulerConfig
from llm_svc.attention.slot_tables import HostSlotTables
from llm_svc.kv.radix import NO_SLOT
from shared.schemas import SamplingParams

pytestmark = pytest.mark.unit


def make(cfg: SchedulerConfig, full: int = 400, swa: int = 200) -> tuple[Scheduler, SimRunner]:
    sched = Scheduler(cfg, full, swa)
    return sched, SimRunner(lambda rid: sched.requests[rid], cfg.window)


def req(rid: str, prompt: list[int], max_tokens: int = 4, **kw) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), **kw)


def drive(sched: Scheduler, runner: SimRunner, max_steps: int = 10_000, on_step=None):
    outs = []
    for _ in range(max_steps):
        batch = sched.schedule()
        if batch is None:
            break
        if on_step:
            on_step(batch)
        outs += sched.postprocess(batch, runner.run(batch))
        sched.check_integrity()
    assert not sched.has_unfinished()
    return outs


def held_swa(r: Request) -> list[int]:
    """Positions whose SWA KV the request reads or owns (a cached window it pins counts)."""
    return [p for p, s in enumerate(r.kv.swa) if s != NO_SLOT]


def test_chunked_prefill_and_decode_against_a_simple_sequence_model():
    w, c, n = 4, 8, 3
    sched, runner = make(SchedulerConfig(max_batch_tokens=c, window=w, decode_release_interval=n))
    prompt = list(range(1, 38))  # 37 tokens: chunks 8,8,8,8,5 then decodes
    r = req("a", prompt, max_tokens=6)
    sched.add(r)
    full_at: dict[int, int] = {}
    swa_at: dict[int, int] = {}
    sizes, logits = [], []
    tables = HostSlotTables()
    expect_start = 0
    while (batch := sched.schedule()) is not None:
        (sf,) = batch.seqs
        start, end = sf.start, sf.end
        assert start == expect_start and list(sf.positions) == list(range(start, end))
        assert sf.token_ids == (prompt + r.output_ids)[start:end]
        # one reset at admission (an empty table), then only the new slots
        assert (sf.reset_full is not None) == (start == 0)
        for i, p in enumerate(sf.positions):
            assert p not in full_at
            full_at[p], swa_at[p] = sf.out_full_slots[i], sf.out_swa_slots[i]
        tables.apply(batch)
        assert tables.ctx_full(sf) == [full_at[q] for q in range(end)]
        assert sf.swa_ctx_start == max(0, start - w + 1)
        assert tables.ctx_swa(sf) == [swa_at[q] for q in range(sf.swa_ctx_start, end)]
        sizes.append(end - start)
        logits.append(sf.need_logits)
        sched.postprocess(batch, runner.run(batch))
        sched.check_integrity()
        expect_start = end
        if not r.is_finished:
            held = held_swa(r)
            # SWA stays O(W + chunk): exactly the window after a chunk, <= W + N in decode
            if end - start > 1:
                assert held == list(range(end - w, end))
            assert len(held) <= w + n
    assert sizes == [8, 8, 8, 8, 5] + [1] * 5
    assert logits == [False] * 4 + [True] * 6
    assert len(r.output_ids) == 6 and r.finish_reason == "length"
    assert len(set(full_at.values())) == len(full_at)


def test_decodes_first_and_token_budget_respected():
    sched, runner = make(SchedulerConfig(max_batch_tokens=10, window=4))
    sched.add(req("a", list(range(1, 6)), max_tokens=20))
    sched.add(req("b", list(range(11, 16)), max_tokens=20))
    seen_mixed = []

    def on_step(batch):
        assert batch.num_tokens <= 10
        kinds = [len(s.token_ids) == 1 and s.need_logits for s in batch.seqs]
        assert kinds == sorted(kinds, reverse=True)  # decodes before prefill chunks
        if True in kinds and False in kinds:
            seen_mixed.append(batch)

    sched.add(req("c", list(range(21, 61)), max_tokens=2))  # 40-token prompt needs chunks
    drive(sched, runner, on_step=on_step)
    assert seen_mixed  # prefill chunks of c ran alongside decodes of a and b


def test_admission_needs_both_pools():
    cfg = SchedulerConfig(max_batch_tokens=16, window=4)
    sched, runner = make(cfg, full=100, swa=cfg.min_swa_slots())
    taken = sched.kv.swa_pool.alloc(sched.kv.swa_pool.num_free - 5)  # leave 5 SWA slots
    r = req("a", list(range(1, 20)))
    sched.add(r)
    assert sched.schedule() is None and r in sched.waiting  # first chunk needs 16 SWA slots
    sched.kv.swa_pool.free(taken)
    taken = sched.kv.full_pool.alloc(sched.kv.full_pool.num_free - 10)  # plenty SWA, 10 full
    assert sched.schedule() is None and r in sched.waiting  # the prompt needs 19 full slots
    sched.kv.full_pool.free(taken)
    drive(sched, runner)
    assert r.finish_reason == "length"


def test_admission_counts_what_eviction_can_free():
    cfg = SchedulerConfig(max_batch_tokens=32, window=4)
    sched, runner = make(cfg, full=100, swa=60)
    for i in range(4):  # 4 distinct cached sequences of 24 tokens fill most of the full pool
        sched.add(req(f"fill{i}", [100 * (i + 1) + j for j in range(21)], max_tokens=4))
        drive(sched, runner)
    assert sched.kv.full_pool.num_free < 30
    r = req("big", list(range(1, 60)), max_tokens=4)
    sched.add(r)
    drive(sched, runner)
    assert r.finish_reason == "length" and sched.num_preemptions == 0
    assert sched.kv.tree.stats["node_evictions"] > 0


def test_preemption_recomputes_and_gives_the_same_tokens():
    cfg = SchedulerConfig(max_batch_tokens=16, window=4, decode_release_interval=2)
    prompts = {f"r{i}": [i * 50 + j for j in range(1, 11)] for i in range(3)}

    def run(full, cache):
        sched, runner = make(SchedulerConfig(**{**cfg.__dict__, "enable_prefix_cache": cache}), full=full, swa=60)
        reqs = [req(k, p, max_tokens=40) for k, p in prompts.items()]
        for r in reqs:
            sched.add(r)
        drive(sched, runner)
        return sched, {r.req_id: r.output_ids for r in reqs}

    _, alone = run(400, False)
    for cache in (True, False):
        sched, outs = run(60, cache)  # 3 x 50 tokens cannot all fit in 60 slots
        assert sched.num_preemptions > 0
        assert outs == alone
        u = sched.kv.usage()
        assert u["full_free"] + u["full_cached"] == u["full_total"]
        assert u["swa_free"] + u["swa_cached"] == u["swa_total"]


@pytest.mark.parametrize("cache", [True, False])
def test_abort_mid_prefill_and_while_waiting_frees_everything(cache):
    cfg = SchedulerConfig(max_batch_tokens=8, window=4, max_running=1, enable_prefix_cache=cache)
    sched, runner = make(cfg)
    a = req("a", list(range(1, 30)))
    b = req("b", list(range(31, 40)))
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    sched.postprocess(batch, runner.run(batch))  # a: first chunk done
    batch = sched.schedule()
    nxt = runner.run(batch)
    assert sched.abort("a")  # the client left while a's second chunk was running
    assert sched.abort("b")  # never admitted
    assert not sched.abort("b")
    assert sched.postprocess(batch, nxt) == []
    sched.check_integrity()
    assert a.finish_reason == b.finish_reason == "abort"
    assert sched.kv.full_pool.num_free + sched.kv.tree.full_tokens == 400
    assert sched.kv.swa_pool.num_free + sched.kv.tree.swa_tokens == 200
    assert sched.kv.tree.full_tokens == (8 if cache else 0)  # a's computed chunk is reusable


def test_stop_conditions_and_engine_finish():
    cfg = SchedulerConfig(max_batch_tokens=64, window=4)
    sched, _ = make(cfg)
    script = {"eos": [5, 7, 9], "stopid": [5, 6], "ign": [7, 7, 7], "len": [1, 2, 3], "strg": [4, 4, 4, 4]}
    runner = SimRunner(lambda rid: sched.requests[rid], 4, next_token=lambda r, sf: script[r.req_id][len(r.output_ids)])
    sp = SamplingParams
    reqs = [
        Request("eos", [1, 2], sp(max_tokens=9), eos_token_ids=[7]),
        Request("stopid", [1, 2], sp(max_tokens=9, stop_token_ids=[6]), eos_token_ids=[7]),
        Request("ign", [1, 2], sp(max_tokens=3, ignore_eos=True), eos_token_ids=[7]),
        Request("len", [1, 2], sp(max_tokens=3)),
        Request("strg", [1, 2], sp(max_tokens=9)),
    ]
    for r in reqs:
        sched.add(r)
    finished = {}
    while (batch := sched.schedule()) is not None:
        for o in sched.postprocess(batch, runner.run(batch)):
            if o.finished:
                finished[o.req_id] = o.finish_reason
        if "strg" in sched.requests and len(sched.requests["strg"].output_ids) == 2:
            assert sched.finish("strg", "stop")  # the engine matched a stop string
        sched.check_integrity()
    assert finished == {"eos": "stop", "stopid": "stop", "ign": "length", "len": "length"}
    out = {r.req_id: (r.output_ids, r.finish_reason) for r in reqs}
    assert out["eos"] == ([5, 7], "stop") and out["stopid"] == ([5, 6], "stop")
    assert out["ign"] == ([7, 7, 7], "length") and out["strg"] == ([4, 4], "stop")
    assert not sched.finish("strg")


def test_cached_tokens_reported_for_a_repeated_prefix():
    sched, runner = make(SchedulerConfig(max_batch_tokens=64, window=4))
    first = req("a", list(range(1, 30)), max_tokens=3)
    sched.add(first)
    drive(sched, runner)
    nxt = req("b", first.all_ids + [77, 78], max_tokens=2)  # next turn of the conversation
    sched.add(nxt)
    outs = drive(sched, runner)
    assert {o.num_cached_tokens for o in outs} == {31}  # 29 prompt + 3 outputs - 1 uncomputed
    assert sched.stats()["cached_tokens"] == 31


def test_bidirectional_spans_are_never_split():
    sched, runner = make(SchedulerConfig(max_batch_tokens=8, window=4))
    r = req("g", list(range(1, 25)), mm_spans=[(5, 10, 0), (16, 4, 1)], bidirectional=True, mm_items=["i0", "i1"])
    sched.add(r)
    chunks = []
    drive(sched, runner, on_step=lambda b: chunks.extend(b.seqs))
    pre = [s for s in chunks if not (len(s.token_ids) == 1 and s.start >= 24)]
    bounds = [(s.start, s.start + len(s.token_ids)) for s in pre]
    # stop before a span; a span longer than the step budget goes in one piece
    assert bounds == [(0, 5), (5, 15), (15, 23), (23, 24)]
    assert pre[1].bidirectional_spans == [(5, 15)] and pre[2].bidirectional_spans == [(16, 20)]
    assert pre[1].mm_rows == [(i, i, 0) for i in range(10)]
    assert pre[2].mm_rows == [(1 + i, i, 1) for i in range(4)] and pre[2].mm_items == ["i0", "i1"]
    assert pre[0].mm_rows == [] and pre[3].bidirectional_spans == []


def test_causal_media_spans_split_with_row_offsets():
    sched, runner = make(SchedulerConfig(max_batch_tokens=8, window=4))
    r = req("m", list(range(1, 20)), mm_spans=[(5, 10, 0)])
    sched.add(r)
    chunks = []
    drive(sched, runner, on_step=lambda b: chunks.extend(b.seqs))
    assert chunks[0].mm_rows == [(5, 0, 0), (6, 1, 0), (7, 2, 0)]
    assert chunks[1].mm_rows == [(i, 3 + i, 0) for i in range(7)]
    assert chunks[0].bidirectional_spans == []


def test_compute_aware_policy_prefers_short_uncached_with_aging():
    long_r = req("long", list(range(1, 200)))
    short_r = req("short", list(range(300, 310)))
    long_r.arrival_time, short_r.arrival_time = 100.0, 101.0
    no_cache = lambda keys: 0  # noqa: E731
    assert [r.req_id for r in FCFSPolicy().order([long_r, short_r], 102.0, no_cache)] == ["long", "short"]
    pol = ComputeAwarePolicy(aging_tokens_per_s=10.0)
    assert [r.req_id for r in pol.order([long_r, short_r], 102.0, no_cache)] == ["short", "long"]
    # a long prompt that has waited long goes before a short one that just arrived
    short_r.arrival_time = 139.0
    assert [r.req_id for r in pol.order([long_r, short_r], 140.0, no_cache)] == ["long", "short"]
    # a cached long prompt is cheap
    assert pol.order([long_r, short_r], 102.0, lambda k: 195 if len(k) > 100 else 0)[0] is long_r


def test_config_and_request_validation():
    with pytest.raises(ValueError):
        SchedulerConfig(max_batch_tokens=0)
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy="nope")
    with pytest.raises(ValueError, match="too small"):
        Scheduler(SchedulerConfig(window=128, max_batch_tokens=512), 10_000, 500)
    sched, _ = make(SchedulerConfig(max_batch_tokens=16, window=4), full=50)
    with pytest.raises(ValueError, match="KV slots"):
        sched.add(req("x", list(range(1, 40)), max_tokens=20))
    sched.add(req("y", [1, 2]))  # a duplicate id is the front's check (test_llm_hardening)
    with pytest.raises(ValueError):
        Request("z", [])
    with pytest.raises(ValueError):
        Request("z", [1, 2, 3], prompt_keys=[1, 2])
    with pytest.raises(ValueError):
        Request("z", [1, 2, 3], mm_spans=[(2, 5, 0)])


def test_swa_checkpoint_makes_the_system_prompt_reusable():
    system = list(range(100, 140))  # 40 tokens, W = 4
    for marks, expect in (([], 0), ([40], 40)):
        sched, runner = make(SchedulerConfig(max_batch_tokens=16, window=4))
        a = req("a", system + [1, 2, 3], max_tokens=2, swa_checkpoints=marks)
        sched.add(a)
        drive(sched, runner)
        b = req("b", system + [7, 8, 9], max_tokens=2)
        sched.add(b)
        drive(sched, runner)
        assert b.num_cached_tokens == expect
    with pytest.raises(ValueError):
        req("c", [1, 2], swa_checkpoints=[3])


def test_max_chunk_tokens_lets_several_prefills_share_a_step():
    sched, runner = make(SchedulerConfig(max_batch_tokens=32, max_chunk_tokens=8, window=4))
    for i in range(3):
        sched.add(req(f"p{i}", [i * 100 + j for j in range(1, 21)]))
    sizes = []
    drive(sched, runner, on_step=lambda b: sizes.append(sorted(len(s.token_ids) for s in b.seqs)))
    assert sizes[0] == [8, 8, 8]
    assert max(max(s) for s in sizes) == 8
    with pytest.raises(ValueError):
        SchedulerConfig(max_batch_tokens=8, max_chunk_tokens=9)


def test_follow_up_turn_reuses_the_previous_prompt_when_the_answer_retokenizes():
    """A follow-up turn re-sends turn 0's whole prompt but not the generated token ids (the
    client's text of the answer re-tokenizes differently): the window ending at the prompt's end
    is kept when turn 0 finishes, so the whole previous prompt is a window-safe hit."""
    w = 8
    cfg = SchedulerConfig(max_batch_tokens=16, window=w, decode_release_interval=4)
    sched, runner = make(cfg, full=400, swa=cfg.min_swa_slots())
    prompt0 = [100 + i for i in range(40)]
    t0 = req("t0", prompt0, max_tokens=3 * w)  # the answer runs well past one window
    sched.add(t0)
    drive(sched, runner)
    assert len(t0.output_ids) == 3 * w
    retokenized = [(t + 1) % 40 for t in t0.output_ids]  # never the generated ids
    t1 = req("t1", prompt0 + retokenized + [7, 8, 9], max_tokens=4)
    sched.add(t1)
    drive(sched, runner)  # SimRunner(verify) raises on any pseudo-hit
    assert t1.num_cached_tokens == len(prompt0)
    # the kept window is cached, evictable SWA: a request needing the whole SWA pool still runs
    sched.check_integrity()
    assert sched.kv.tree.evictable_swa() == sched.kv.tree.swa_tokens > 0


def _outputs_with_cache(cache: bool, late_start: bool) -> tuple[dict[str, list[int]], dict[str, int]]:
    """A decodes while B and C (same long system prompt) arrive; with ``late_start`` they arrive
    after A's prefill completed, else all three are admitted together."""
    cfg = SchedulerConfig(max_batch_tokens=16, window=4, decode_release_interval=3, enable_prefix_cache=cache)
    sched, runner = make(cfg)
    system = list(range(100, 140))
    a = req("a", system + [1, 2, 3], max_tokens=12)
    others = [req("b", system + [1, 2, 3, 7, 8], max_tokens=5), req("c", system + [1, 2, 3], max_tokens=5)]
    sched.add(a)
    if not late_start:
        for r in others:
            sched.add(r)
    while (batch := sched.schedule()) is not None:
        sched.postprocess(batch, runner.run(batch))
        sched.check_integrity()
        if late_start and a.output_ids and others[0].req_id not in sched.requests and not others[0].is_finished:
            assert not a.is_finished
            for r in others:
                sched.add(r)
    assert all(r.is_finished for r in (a, *others))
    assert sched.kv.full_pool.num_free + sched.kv.tree.full_tokens == sched.kv.full_pool.num_slots
    return {r.req_id: r.output_ids for r in (a, *others)}, {r.req_id: r.num_cached_tokens for r in (a, *others)}


@pytest.mark.parametrize("late_start", [True, False])
def test_running_request_prompt_is_shared_with_concurrent_requests(late_start):
    """A running request's prompt goes into the tree when its prefill completes: requests that
    arrive while it still decodes hit all of it (SimRunner checks every slot they read holds the
    right KV), requests prefilled in the same steps hand their duplicate slots back, and outputs
    equal a caching-off run."""
    outs_on, cached = _outputs_with_cache(True, late_start)
    outs_off, _ = _outputs_with_cache(False, late_start)
    assert outs_on == outs_off
    if late_start:
        assert cached == {"a": 0, "b": 43, "c": 42}  # c: all but its last prompt token
    else:  # b shares a's last prefill step (computes the prompt too, then hands its copies
        # back when it caches), c is admitted after a's prompt is in the tree
        assert cached == {"a": 0, "b": 0, "c": 42}


@pytest.mark.parametrize("cache", [True, False])
def test_identical_prompts_share_one_prefill(cache):
    """Four requests with one prompt (n = 4's choices): with the prefix cache, the first
    prefills it and the others wait, then compute only the last prompt token; without it each
    computes the whole prompt. Same outputs either way."""
    sched, runner = make(SchedulerConfig(max_batch_tokens=16, window=4, enable_prefix_cache=cache), full=600)
    prompt = list(range(1, 50))
    computed: list[int] = []
    for i in range(4):
        sched.add(req(f"c{i}", prompt, max_tokens=3))
    outs = drive(sched, runner, on_step=lambda b: computed.extend(
        len(s.token_ids) for s in b.seqs if s.start < len(prompt)))
    prefill = sum(computed)
    assert prefill == (len(prompt) + 3 * 1 if cache else 4 * len(prompt)), prefill
    toks = {i: [o.token_id for o in outs if o.req_id == f"c{i}"] for i in range(4)}
    assert all(t == toks[0] for t in toks.values()) and len(toks[0]) == 3


def test_drafts_share_the_steps_draft_budget():
    """Speculative decoding: 16 decodes with 4 drafts each under a budget of 32 draft tokens
    verify 2 each; drafts that fit the budget in all (uneven) are all verified; one decode alone
    verifies all 4."""
    from llm_svc.engine.scheduler import Scheduler, SchedulerConfig
    from llm_svc.types.request import Request
    from shared.schemas import SamplingParams

    cfg = SchedulerConfig(max_batch_tokens=512, window=16, max_draft_tokens=32)
    s = Scheduler(cfg, 4096, cfg.min_swa_slots() * 4)
    reqs = [Request(f"r{i}", list(range(5 + i, 15 + i)), SamplingParams(max_tokens=50)) for i in range(16)]
    for r in reqs:
        s.add(r)
    batch = s.schedule()
    s.postprocess(batch, {sf.req_id: 7 for sf in batch.seqs})
    for r in reqs:
        r.spec_tokens = [1, 2, 3, 4]
    batch = s.schedule()
    assert [sf.num_drafts for sf in batch.seqs] == [2] * 16
    s.postprocess(batch, {sf.req_id: [1, 2, 9] for sf in batch.seqs})
    s.check_integrity()
    for i, r in enumerate(reqs):  # drafts the policy shared out within the budget: all verified
        r.spec_tokens = [1, 2, 3, 4] if i < 6 else [1] if i < 14 else []
    batch = s.schedule()
    assert [sf.num_drafts for sf in batch.seqs] == [4] * 6 + [1] * 8 + [0] * 2
    s.postprocess(batch, {sf.req_id: [1] for sf in batch.seqs})
    s.check_integrity()
    for r in reqs[1:]:
        s.abort(r.req_id)
    reqs[0].spec_tokens = [1, 2, 3, 4]
    batch = s.schedule()
    assert [sf.num_drafts for sf in batch.seqs] == [4]
    s.postprocess(batch, {"r0": [1, 5]})  # one draft kept: the other three positions' slots go back
    s.check_integrity()
    assert len(reqs[0].kv.full) == reqs[0].num_computed == reqs[0].num_tokens - 1


def test_prefill_step_tokens_starts_later_prompts_next_step():
    """With ``prefill_step_tokens`` a step that holds that many prompt tokens admits no more
    waiting prompts: three prompts that arrive together prefill in three steps, each finishing a
    step sooner than the one before, and decodes ride along; off (0) they share one step."""
    def first_tokens(limit: int) -> tuple[list[list[tuple[str, int]]], dict[str, int]]:
        sched, runner = make(SchedulerConfig(max_batch_tokens=64, window=4, prefill_step_tokens=limit), 600, 300)
        for i in range(3):
            sched.add(req(f"p{i}", list(range(1 + i, 13 + i)), max_tokens=3))  # 12 tokens each
        steps, first = [], {}

        def on_step(batch):
            steps.append([(sf.req_id, len(sf.token_ids)) for sf in batch.seqs])
            for sf in batch.seqs:
                if sf.end >= 12:
                    first.setdefault(sf.req_id, len(steps))

        outs = drive(sched, runner, on_step=on_step)
        assert sorted({o.req_id for o in outs}) == ["p0", "p1", "p2"]
        return steps, first

    steps, first = first_tokens(10)
    assert steps[:3] == [[("p0", 12)], [("p0", 1), ("p1", 12)], [("p0", 1), ("p1", 1), ("p2", 12)]]
    assert first == {"p0": 1, "p1": 2, "p2": 3}
    steps, first = first_tokens(0)
    assert steps[0] == [("p0", 12), ("p1", 12), ("p2", 12)] and first == {"p0": 1, "p1": 1, "p2": 1}
    with pytest.raises(ValueError):
        SchedulerConfig(prefill_step_tokens=-1)
