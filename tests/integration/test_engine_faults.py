"""An exception injected at each point of the engine's step fails only what it must, the rest
finishes exactly as in a clean run, the bookkeeping stays sound, and an engine whose state is
no longer sound raises ``EngineBroken`` (the core process then exits and is restarted)."""

from __future__ import annotations

import pytest

from llm_svc.engine.engine import EngineBroken
from tests.integration.test_llm_engine import ListStream, image_prep, make_engine

pytestmark = pytest.mark.integration


class Once:
    """Wraps ``fn``: raises ``RuntimeError("injected")`` on the first call where ``when(args)``."""

    def __init__(self, fn, when=lambda *a, **k: True):
        self.fn, self.when, self.fired = fn, when, False

    def __call__(self, *args, **kwargs):
        if not self.fired and self.when(*args, **kwargs):
            self.fired = True
            raise RuntimeError("injected")
        return self.fn(*args, **kwargs)


def preps(lm):
    return [image_prep(lm, f"r{i}", 20 + 9 * i, None, 70 + i, max_tokens=12) for i in range(3)]


def drive(engine, reqs, after_submit=None, max_steps=400):
    streams = {p.request_id: ListStream(p.request_id) for p in reqs}
    for p in reqs:
        engine.submit(p, streams[p.request_id])
    if after_submit:
        after_submit(engine)
    for _ in range(max_steps):
        if all(s.done for s in streams.values()):
            break
        engine.step()
        engine.scheduler.check_integrity()
    assert all(s.done for s in streams.values()), "engine did not finish"
    u = engine.scheduler.stats()
    assert u["running"] == u["waiting"] == 0 and engine.engine.num_live == 0
    assert u["full_free"] + u["full_cached"] == u["full_total"]
    return streams


@pytest.fixture(scope="module")
def clean(mimo16):
    return {rid: s.tokens for rid, s in drive(make_engine(mimo16, max_batch_tokens=24), preps(mimo16)).items()}


def failed(streams):
    return sorted(rid for rid, s in streams.items() if s.outs[-1].error)


def assert_rest_clean(streams, clean):
    for rid, s in streams.items():
        if not s.outs[-1].error:
            assert s.tokens == clean[rid], rid
            assert s.outs[-1].finish_reason == "length"


def test_run_failure_fails_only_the_batch(mimo16, clean):
    engine = make_engine(mimo16, max_batch_tokens=24)
    # r2's prompt (38 tokens) needs two chunks; fail the first step that holds it and no other
    engine.engine.runner.run = Once(engine.runner.run, lambda b: [s.req_id for s in b.seqs] == ["r2"])
    streams = drive(engine, preps(mimo16))
    assert engine.engine.runner.run.fired
    assert failed(streams) == ["r2"]
    assert "RuntimeError" in streams["r2"].outs[-1].error and streams["r2"].outs[-1].error_status == 500
    assert_rest_clean(streams, clean)


@pytest.mark.parametrize("point", ["postprocess", "sample"])
def test_postprocess_or_sample_failure_fails_the_batch(mimo16, clean, point, monkeypatch):
    engine = make_engine(mimo16, max_batch_tokens=24)
    if point == "postprocess":
        engine.scheduler.postprocess = Once(engine.scheduler.postprocess)
    else:
        import llm_svc.engine.engine as mod

        monkeypatch.setattr(mod, "sample", Once(mod.sample))
    streams = drive(engine, preps(mimo16))
    assert 0 < len(failed(streams)) < 3  # the first batch's requests, not r2 (not in it)
    assert_rest_clean(streams, clean)
    # the engine keeps serving: a new request afterwards finishes like in a clean run
    again = image_prep(mimo16, "r0", 20, None, 70, max_tokens=12)
    assert drive(engine, [again])["r0"].tokens == clean["r0"]


def test_schedule_failure_fails_live_requests_and_engine_keeps_serving(mimo16, clean):
    engine = make_engine(mimo16, max_batch_tokens=24)
    streams = {p.request_id: ListStream(p.request_id) for p in preps(mimo16)}
    for p in preps(mimo16):
        engine.submit(p, streams[p.request_id])
    engine.step()
    engine.scheduler.schedule = Once(engine.scheduler.schedule)
    engine.step()  # raises inside: every live request fails (the scheduler's state is unknown)
    assert failed(streams) == ["r0", "r1", "r2"]
    engine.scheduler.check_integrity()
    again = image_prep(mimo16, "r1", 29, None, 71, max_tokens=12)
    assert drive(engine, [again])["r1"].tokens == clean["r1"]


def test_abort_failure_fails_only_its_target(mimo16, clean):
    engine = make_engine(mimo16, max_batch_tokens=24)
    engine.scheduler.abort = Once(engine.scheduler.abort, lambda rid: rid == "r1")
    streams = drive(engine, preps(mimo16), after_submit=lambda e: e.abort("r1"))
    assert failed(streams) == ["r1"]
    assert_rest_clean(streams, clean)


def test_orphan_closing_failure_fails_only_the_orphan(mimo16, clean):
    engine = make_engine(mimo16, max_batch_tokens=24)
    core = engine.engine
    core._close_orphans = Once(core._close_orphans, lambda gone: bool(gone))

    def drop_r0(e):  # the scheduler drops r0 on its own (as when it can never fit alone)
        e.scheduler.abort("r0")

    streams = drive(engine, preps(mimo16), after_submit=drop_r0)
    assert core._close_orphans.fired
    assert failed(streams) == ["r0"]
    assert_rest_clean(streams, clean)


def test_unsound_state_after_a_failure_raises_engine_broken(mimo16):
    engine = make_engine(mimo16, max_batch_tokens=24)
    for p in preps(mimo16):
        engine.submit(p, ListStream(p.request_id))
    engine.engine.runner.run = Once(engine.runner.run)

    def broken():
        raise AssertionError("full: free + cached + in use != total (leak)")

    engine.scheduler.check_integrity = broken
    with pytest.raises(EngineBroken, match="leak"):
        engine.step()
