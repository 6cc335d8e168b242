"""Admission of requests whose media is known by reference only (``mm_items[i] is None``): the
scheduler asks for exactly the items whose spans end past the cached prefix, never admits a
request without them, and asks nothing when the prefix cache covers the media."""

from __future__ import annotations

import pytest

from mmserve.testing.sched_sim import SimRunner
from llm_svc.engine.scheduler import Scheduler, SchedulerConfig
from llm_svc.types.request import Request, make_prompt_keys
from shared.schemas import SamplingParams

pytestmark = pytest.mark.unit

IMG = object()  # stands for a tensor: the scheduler only looks at presence


def make() -> tuple[Scheduler, SimRunner]:
    sched = Scheduler(SchedulerConfig(max_batch_tokens=16, window=4), 600, 300)
    return sched, SimRunner(lambda rid: sched.requests[rid], 4)


def media_req(rid: str, prompt: list[int], spans: list[tuple[int, int, int]], items: list, max_tokens: int = 3) -> Request:
    keys = make_prompt_keys(prompt, spans, [f"key{i}" for i in range(len(items))])
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), prompt_keys=keys,
                   mm_items=items, mm_spans=spans)


def run_to_end(sched: Scheduler, runner: SimRunner, max_steps: int = 1000) -> list:
    outs = []
    for _ in range(max_steps):
        batch = sched.schedule()
        if batch is None:
            break
        for sf in batch.seqs:  # the runner would read these rows: they must exist
            for _, _, idx in sf.mm_rows:
                assert sf.mm_items[idx] is not None
        outs += sched.postprocess(batch, runner.run(batch))
        sched.check_integrity()
    return outs


def test_missing_media_is_asked_for_once_and_admits_after_it_arrives():
    sched, runner = make()
    prompt = [1, 2, 3] + [99] * 8 + [4, 5, 6]
    r = media_req("a", prompt, [(3, 8, 0)], [None])
    sched.add(r)
    assert sched.schedule() is None  # nothing admissible: it waits for its media
    assert sched.take_media_needs() == [("a", [0])]
    assert r.awaiting_media and r.kv is None
    sched.check_integrity()
    assert sched.schedule() is None and sched.take_media_needs() == []  # asked once per wait
    assert sched.provide_media("a", {0: IMG})
    outs = run_to_end(sched, runner)
    assert [o.req_id for o in outs if o.finished] == ["a"]
    assert not sched.has_unfinished()
    assert sched.provide_media("a", {0: IMG}) is False  # gone: ignored


def test_a_prefix_cache_hit_over_the_media_needs_no_fetch():
    sched, runner = make()
    turn1 = [1, 2, 3] + [99] * 8 + [4, 5, 6, 7, 8, 9, 10, 11]
    sched.add(media_req("t1", turn1, [(3, 8, 0)], [IMG]))
    run_to_end(sched, runner)
    # turn 2 re-sends turn 1's image by reference, plus a new one past the cached prefix
    turn2 = turn1 + [20, 21, 22] + [98] * 8 + [23, 24]
    r2 = media_req("t2", turn2, [(3, 8, 0), (22, 8, 1)], [None, None])
    sched.add(r2)
    assert sched.schedule() is None
    assert sched.take_media_needs() == [("t2", [1])]  # item 0 is inside the cached prefix
    sched.provide_media("t2", {1: IMG})
    run_to_end(sched, runner)
    assert r2.num_cached_tokens >= 11 and r2.mm_items[0] is None  # admitted without ever fetching it


def test_other_requests_are_admitted_while_one_waits():
    sched, runner = make()
    waiting = media_req("m", [1] + [99] * 8 + [2], [(1, 8, 0)], [None])
    sched.add(waiting)
    sched.add(Request("text", [5, 6, 7, 8], SamplingParams(max_tokens=2, ignore_eos=True)))
    batch = sched.schedule()
    assert [sf.req_id for sf in batch.seqs] == ["text"]
    assert sched.take_media_needs() == [("m", [0])]
    sched.postprocess(batch, runner.run(batch))
    sched.abort("m")  # a waiting request can be aborted like any other
    run_to_end(sched, runner)
    assert not sched.has_unfinished()
    sched.check_integrity()


def test_a_preempted_request_whose_cached_media_was_evicted_asks_again():
    sched, runner = make()
    turn1 = [1, 2, 3] + [99] * 8 + [4, 5, 6, 7]
    sched.add(media_req("t1", turn1, [(3, 8, 0)], [IMG]))
    run_to_end(sched, runner)
    r2 = media_req("t2", turn1 + [8, 9, 10], [(3, 8, 0)], [None], max_tokens=20)
    sched.add(r2)
    batch = sched.schedule()  # the cached prefix covers the image: admitted without it
    assert [sf.req_id for sf in batch.seqs] == ["t2"] and sched.take_media_needs() == []
    sched.postprocess(batch, runner.run(batch))
    sched._preempt(r2)  # room was needed elsewhere; then the tree lost the image's KV
    sched.kv.tree.evict(sched.kv.full_pool.num_slots, sched.kv.swa_pool.num_slots)
    sched.check_integrity()
    assert sched.schedule() is None
    assert sched.take_media_needs() == [("t2", [0])]  # recomputing the image needs its rows now
    sched.provide_media("t2", {0: IMG})
    outs = run_to_end(sched, runner)
    assert [o.req_id for o in outs if o.finished] == ["t2"] and r2.num_preemptions == 1
