"""The grammar compile pool without a model (a 96-token vocabulary): a spec over the size limit
starts nothing; a compile past its CPU-time limit is killed while another worker serves a simple
one; a queued compile nobody waits for never runs, a running one is killed; a bad spec's error
names the problem, not xgrammar's sources; a long compile is stopped part of each period past
its full-speed CPU seconds and its worker runs on after it; closing kills and reaps every worker."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from llm_svc.engine.grammar import GrammarCache
from llm_svc.engine.grammar_errors import CompilerUnavailable, CompileTimeout, GrammarError, GrammarTooLarge
from llm_svc.engine.grammar_pool import CompilePool, Job
from shared.schemas import StructuredSpec

HOSTILE = json.dumps({"type": "string", "pattern": "(a|b){16000}"})  # about a minute of CPU alone
SIMPLE = json.dumps({"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]})


def _table() -> str:
    import xgrammar as xgr

    return xgr.TokenizerInfo([chr(c) for c in range(32, 127)] + ["</s>"], stop_token_ids=[95]).serialize_json()


class Results:
    """Each job's outcome (``on_done``), waited for by payload."""

    def __init__(self) -> None:
        self.got: dict[str, tuple[str | None, BaseException | None]] = {}
        self.cond = threading.Condition()

    def __call__(self, job: Job, result, error) -> None:
        with self.cond:
            self.got[job.key] = (result, error)
            self.cond.notify_all()

    def wait(self, key: str, timeout: float = 120.0):
        with self.cond:
            assert self.cond.wait_for(lambda: key in self.got, timeout), key
            return self.got[key]


def _until(cond, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_an_oversized_spec_is_refused_before_anything_starts():
    cache = GrammarCache(None, 0, [], max_bytes=1024)
    with pytest.raises(GrammarTooLarge, match="MMSERVE_LLM_MAX_GRAMMAR_BYTES") as e:
        cache.submit(StructuredSpec(kind="regex", spec="a" * 1025))
    assert e.value.code == "grammar_too_large" and "1025 bytes" in e.value.message
    assert cache.stats()["grammar_worker_starts"] == 0 and cache.worker_pids() == []
    cache.close()


def test_a_compile_past_its_limit_is_killed_while_another_worker_serves():
    done = Results()
    pool = CompilePool(_table, workers=2, timeout_s=1.0)
    try:
        pool.submit(["json", HOSTILE, True], done, key="hostile", timeout_message="too slow")
        pool.submit(["json", SIMPLE, True], done, key="simple")
        result, error = done.wait("simple")
        assert error is None and json.loads(result)  # a serialized CompiledGrammar
        assert "hostile" not in done.got  # served while the hostile one compiled
        result, error = done.wait("hostile")
        assert isinstance(error, CompileTimeout) and str(error) == "too slow" and result is None
        stats = pool.stats()
        assert stats["grammar_timeouts"] == 1 and stats["grammar_running"] == 0
        # compiles run only when nothing else wants the CPU (preempted at once by a waking step)
        assert pool.worker_pids() and all(os.sched_getscheduler(p) == os.SCHED_IDLE for p in pool.worker_pids())
    finally:
        pids = pool.worker_pids()
        pool.close()
    assert not any(_alive(p) for p in pids)


def test_cancelled_compiles_are_dropped_and_errors_say_what_is_wrong():
    done = Results()
    pool = CompilePool(_table, workers=1, timeout_s=600.0, grace_s=0.2)
    try:
        running = pool.submit(["json", HOSTILE, True], done, key="running")
        _until(lambda: pool.stats()["grammar_running"] == 1)
        queued = pool.submit(["json", HOSTILE.replace("a|b", "c|d"), True], done, key="queued")
        pool.cancel(queued)  # behind the running one on the only worker: never runs
        assert pool.stats()["grammar_queued"] == 0
        pool.submit(["regex", "(unclosed", True], done, key="bad")
        pool.cancel(running)  # running: killed after grace_s, the worker replaced
        _, error = done.wait("bad")
        assert isinstance(error, GrammarError) and "regex" in str(error) and "parenthesis" in str(error)
        assert ".cc:" not in str(error) and "/project" not in str(error)
        stats = pool.stats()
        assert stats["grammar_abandoned"] == 1 and stats["grammar_timeouts"] == 0
        assert "running" not in done.got and "queued" not in done.got
        hang = pool.submit(["json", HOSTILE.replace("a|b", "e|f"), True], done, key="at_close")
    finally:
        pids = pool.worker_pids()
        pool.close()
    _, error = done.wait("at_close")
    assert isinstance(error, CompilerUnavailable) and not hang.cancelled
    assert pids and not any(_alive(p) for p in pids)
    assert not [t for t in threading.enumerate() if t.name == "grammar-pool"]
    with pytest.raises(CompilerUnavailable):
        pool.submit(["json", SIMPLE, True], done, key="after")


def test_workers_past_the_warm_one_exit_when_idle(monkeypatch):
    from llm_svc.engine import grammar_pool

    monkeypatch.setattr(grammar_pool, "IDLE_RETIRE_S", 0.5)
    done = Results()
    pool = CompilePool(_table, workers=2, timeout_s=60.0)
    try:
        pool.submit(["json", HOSTILE.replace("16000", "5000"), True], done, key="one")  # seconds
        _until(lambda: pool.stats()["grammar_running"] == 1)
        pool.submit(["regex", "[a-c]+", True], done, key="two")  # the only worker is busy: a second starts
        assert done.wait("one")[1] is None and done.wait("two")[1] is None
        assert pool.stats()["grammar_worker_starts"] == 2
        _until(lambda: pool.stats()["grammar_workers"] == 1)
        (warm,) = pool.worker_pids()
        pool.submit(["regex", "[d-f]+", True], done, key="three")  # the warm one serves it, nothing starts
        assert done.wait("three")[1] is None and pool.worker_pids() == [warm]
        assert pool.stats()["grammar_worker_starts"] == 2
    finally:
        pool.close()


def test_a_long_compile_is_stopped_part_of_the_time_and_its_worker_runs_on_after_it():
    done = Results()
    with pytest.raises(ValueError, match="slow_share"):
        CompilePool(_table, slow_share=0.0)
    pool = CompilePool(_table, workers=1, timeout_s=120.0, full_speed_s=0.2, slow_share=0.5)
    assert pool.wall_limit >= 10.0 * (0.2 + 119.8 / 0.5)  # the wall backstop leaves room for the share
    try:
        pool.submit(["json", HOSTILE.replace("16000", "3000"), True], done, key="long")  # ~1.6 s of CPU
        stopped = []

        def paused_or_done() -> bool:
            pids = pool.worker_pids()
            if pids and _state(pids[0]) == "T":
                stopped.append(pids[0])
            return bool(stopped) or "long" in done.got

        _until(paused_or_done)
        assert stopped, "the compile was never stopped past its full-speed CPU seconds"
        result, error = done.wait("long")
        assert error is None and json.loads(result)  # throttled, not failed
        assert pool.stats()["grammar_throttled"] == 1
        pool.submit(["regex", "[a-c]+", True], done, key="next")
        assert done.wait("next", timeout=30)[1] is None  # the same worker, not left stopped
        assert pool.worker_pids() == stopped[:1] and _state(stopped[0]) != "T"
        assert pool.stats()["grammar_worker_starts"] == 1
    finally:
        pids = pool.worker_pids()
        pool.close()
    assert not any(_alive(p) for p in pids)
