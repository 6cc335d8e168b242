"""The engine's per-request record (``llm_svc.engine.live.Live``) and its single release: every
way a request ends (finish, abort, failure, dropped by the scheduler) leaves no record and whole
KV pools, and each stage's release drops the field it owns. A fake runner with known answers
(the next token is the position mod V), no model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llm_svc.engine.engine import Engine
from llm_svc.engine.live import Live
from llm_svc.engine.scheduler import Scheduler, SchedulerConfig
from llm_svc.types.request import Request
from shared.schemas import SamplingParams

pytestmark = pytest.mark.unit

V = 16


class FakeRunner:
    """Logits whose argmax is the next position mod ``V``."""

    device = torch.device("cpu")
    last_hidden = None

    def run(self, batch):
        out = {}
        for sf in batch.seqs:
            if sf.need_logits:
                row = torch.zeros(V)
                row[(sf.start + len(sf.token_ids)) % V] = 5.0
                out[sf.req_id] = row
        return out


def make() -> Engine:
    sched = Scheduler(SchedulerConfig(max_batch_tokens=64, window=8, decode_release_interval=4), 400, 200)
    return Engine(FakeRunner(), sched, eos_token_ids=[])


def req(rid: str, n: int = 10, max_tokens: int = 6) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))


def whole(e: Engine) -> None:
    e.scheduler.check_integrity()
    u = e.scheduler.stats()
    assert e.num_live == 0 and not e.scheduler.requests
    assert u["full_free"] + u["full_cached"] == u["full_total"]


def test_a_finished_request_leaves_no_record_and_its_tokens_are_the_known_answers():
    e = make()
    e.add(req("a"))
    outs = []
    for _ in range(20):
        outs += e.step()
        if not e.has_work():
            break
    assert [o.token_id for o in outs] == [(10 + i) % V for i in range(6)]
    assert outs[-1].finish_reason == "length"
    whole(e)


@pytest.mark.parametrize("how", ["abort", "fail", "orphan"])
def test_every_other_ending_goes_through_the_one_release(how):
    e = make()
    for rid in ("a", "b"):
        e.add(req(rid))
    e.step()
    if how == "abort":
        e.abort("a")
        outs = e.step()
        assert [o.finish_reason for o in outs if o.request_id == "a"] == ["abort"]
    elif how == "fail":
        e._out = []
        e._fail(["a"], "injected", status=400)
        assert [(o.error, o.status) for o in e._out] == [("injected", 400)]
    else:
        e.scheduler.abort("a")  # the scheduler drops it on its own
        outs = e.step()
        assert [o.finish_reason for o in outs if o.request_id == "a"] == ["abort"]
    assert "a" not in e._live
    for _ in range(20):
        e.step()
        if not e.has_work():
            break
    whole(e)


def test_the_stages_own_and_release_every_field_of_the_record():
    e = make()
    stage_fields = [f.name for f in dataclasses.fields(Live)][2:]  # past req and generator
    lv = Live(req("a"), None, **{name: object() for name in stage_fields})
    for stage in e._stages:
        stage.release(lv)
    assert all(getattr(lv, name) is None for name in stage_fields)
