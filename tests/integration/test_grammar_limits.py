"""Grammar compile limits (issue 42, item 3): a schema that compiles for minutes is stopped at
``grammar_compile_timeout_s`` with a 400 naming the setting while other structured requests are
served; a spec over ``max_grammar_bytes`` is a 400 before any compile; an aborted request's
compile is killed, not left burning a core. In the engine (``check_integrity`` after) and through
the real LLM service over HTTP (engine core and compile workers in their own processes)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import httpx
import pytest

from llm_svc.engine.grammar import GrammarCache
from shared.schemas import GenerateRequest, PromptMessage, PromptText, SamplingParams, StructuredSpec
from shared.wire import pack
from tests.integration.test_engine_core_process import alive, start
from tests.integration.test_llm_engine import ListStream, make_engine
from tests.integration.test_structured_outputs import _prep, _text

pytestmark = pytest.mark.integration

# Four strings of 16,000 two-way choices each: xgrammar 0.2.9 expands every repetition into its
# states and builds a token mask per state. Unbounded, the four took 140 s of CPU (407 s of wall time
# at the lowest priority on the shared 2-core Xeon); the cost grows faster than the square of the
# count up to about 20,000 (past some count xgrammar no longer expands it: 32,000 compiles in 0.1 s).
HOSTILE = json.dumps({"type": "object", "required": ["p0", "p1", "p2", "p3"], "properties": {
    f"p{i}": {"type": "string", "pattern": f"({a}|{b}){{16000}}"}
    for i, (a, b) in enumerate(("ab", "cd", "ef", "gh"))}})
SIMPLE = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False}


def _json(schema: dict | str) -> StructuredSpec:
    return StructuredSpec(kind="json", spec=schema if isinstance(schema, str) else json.dumps(schema),
                          any_whitespace=False)


# ---------------------------------------------------------------------------------------- engine
def _engine(lm, **grammar):
    eng = make_engine(lm)
    eng.engine.grammars = GrammarCache(lm.tokenizer, lm.vocab_size, lm.eos_token_ids, **grammar)
    return eng


def _settle(eng, until, limit: float = 60.0) -> None:
    """Step the engine until ``until()`` (the compile pool works on its own thread meanwhile)."""
    deadline = time.monotonic() + limit
    while not until():
        assert time.monotonic() < deadline, eng.engine.grammars.stats()
        eng.step()
        time.sleep(0.01)


def test_engine_times_out_a_hostile_schema_and_serves_the_others(mimo16):
    """The hostile compile is killed at the limit: its request fails alone with a 400 naming the
    setting; a simple schema sent after it is answered first; a repeat of the hostile schema fails
    at once (no second compile); nothing leaks."""
    eng = _engine(mimo16, workers=2, timeout_s=10.0)
    try:
        streams = {rid: ListStream(rid) for rid in ("hostile", "ok", "again")}
        eng.submit(_prep(mimo16, "hostile", 1, _json(HOSTILE)), streams["hostile"])
        eng.submit(_prep(mimo16, "ok", 2, _json(SIMPLE), max_tokens=40), streams["ok"])
        order: list[str] = []

        def both_done() -> bool:
            order.extend(r for r in ("hostile", "ok") if streams[r].done and r not in order)
            return len(order) == 2

        _settle(eng, both_done, limit=300)
        assert order == ["ok", "hostile"]  # not queued behind the hostile compile
        assert json.loads(_text(streams["ok"])) in ({"a": True}, {"a": False})
        last = streams["hostile"].outs[-1]
        assert last.error_status == 400 and "MMSERVE_LLM_GRAMMAR_COMPILE_TIMEOUT_S" in last.error
        assert last.error_code == "grammar_compile_timeout"
        eng.submit(_prep(mimo16, "again", 3, _json(HOSTILE)), streams["again"])
        _settle(eng, lambda: streams["again"].done, limit=5)
        assert streams["again"].outs[-1].error_code == "grammar_compile_timeout"
        stats = eng.engine.grammars.stats()
        assert stats["grammar_timeouts"] == 1 and stats["grammar_running"] == stats["grammar_queued"] == 0
        eng.scheduler.check_integrity()
        assert eng.engine.num_live == 0 and not eng.engine._compiling
    finally:
        eng.engine.grammars.close()


def test_engine_drops_an_aborted_compile_and_refuses_oversized_specs(mimo16):
    """An abort while the hostile schema compiles kills its worker (not the limit: it is far
    away), and the pool serves the next request; a spec over max_bytes is refused by ``add``."""
    from llm_svc.types.errors import InvalidRequest

    eng = _engine(mimo16, workers=1, timeout_s=600.0, max_bytes=4096)
    grammars = eng.engine.grammars
    try:
        with pytest.raises(InvalidRequest, match="MMSERVE_LLM_MAX_GRAMMAR_BYTES") as e:
            eng.submit(_prep(mimo16, "big", 0, _json({"enum": ["x" * 5000]})), ListStream("big"))
        assert e.value.code == "grammar_too_large" and grammars.stats()["grammar_worker_starts"] == 0
        gone = ListStream("gone")
        eng.submit(_prep(mimo16, "gone", 1, _json(HOSTILE)), gone)
        _settle(eng, lambda: grammars.stats()["grammar_running"] == 1)
        (pid,) = grammars.worker_pids()
        eng.abort("gone")
        _settle(eng, lambda: gone.done and grammars.stats()["grammar_running"] == 0)
        assert gone.outs[-1].finish_reason == "abort"
        _settle(eng, lambda: not alive(pid))
        stats = grammars.stats()
        assert stats["grammar_abandoned"] == 1 and stats["grammar_timeouts"] == 0
        nxt = ListStream("next")  # on a new worker (the killed one's replacement)
        eng.submit(_prep(mimo16, "next", 2, _json(SIMPLE), max_tokens=40), nxt)
        _settle(eng, lambda: nxt.done)
        assert json.loads(_text(nxt)) in ({"a": True}, {"a": False})
        eng.scheduler.check_integrity()
        assert eng.engine.num_live == 0 and not eng.engine._compiling
    finally:
        pids = grammars.worker_pids()
        grammars.close()
    assert not any(alive(p) for p in pids)  # closing kills and reaps the workers


# ---------------------------------------------------------------------------------------- service
def _body(rid: str, spec: StructuredSpec, stream: bool = False, max_tokens: int = 40) -> bytes:
    req = GenerateRequest(request_id=rid, messages=[PromptMessage(role="user", content=[PromptText(text="answer")])],
                          sampling=SamplingParams(max_tokens=max_tokens, structured=spec), stream=stream)
    return pack({}, req)


def _grammar_stats(svc) -> dict[str, float]:
    return {k: v for k, v in svc.state.backend.stats().tiers.items() if k.startswith("grammar_")}


def _wait(cond, what: str, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _worker_pids(core: int) -> list[int]:
    """The engine core's grammar compile workers."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == core and b"llm_svc.engine.grammar_worker" in cmd:
            out.append(int(pid))
    return out


@pytest.fixture(scope="module")
def service(mimo_bundle):
    with start(mimo_bundle, grammar_workers=2, grammar_compile_timeout_s=15.0, max_grammar_bytes=4096) as svc:
        yield svc


def test_service_refuses_an_oversized_spec_before_compiling(service):
    before = _worker_pids(service.state.backend.client.core_pid)
    spec = _json({"type": "string", "enum": ["x" * 5000]})
    r = httpx.post(service.url + "/v1/generate", content=_body("big", spec), timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "MMSERVE_LLM_MAX_GRAMMAR_BYTES" in err["message"] and err["code"] == "grammar_too_large"
    assert _worker_pids(service.state.backend.client.core_pid) == before  # no compile started for it


def test_service_times_out_a_hostile_schema_while_serving_others(service):
    """The hostile request gets a 400 naming the setting; a structured request sent while it
    compiles is answered correctly before that (it is not queued behind it), and so is one after."""
    done: list[tuple[str, httpx.Response]] = []

    def send(rid: str, spec: StructuredSpec) -> None:
        done.append((rid, httpx.post(service.url + "/v1/generate", content=_body(rid, spec), timeout=300)))

    hostile = threading.Thread(target=send, args=("hostile", _json(HOSTILE)))
    hostile.start()
    _wait(lambda: _grammar_stats(service).get("grammar_running") == 1, "the hostile compile never started")
    send("ok", _json(SIMPLE))
    hostile.join(300)
    assert [rid for rid, _ in done] == ["ok", "hostile"]
    res = dict(done)
    assert res["ok"].status_code == 200, res["ok"].text
    assert json.loads(res["ok"].json()["text"]) in ({"a": True}, {"a": False})
    assert res["hostile"].status_code == 400, res["hostile"].text
    err = res["hostile"].json()["error"]
    assert "MMSERVE_LLM_GRAMMAR_COMPILE_TIMEOUT_S" in err["message"] and err["code"] == "grammar_compile_timeout"
    assert "Traceback" not in err["message"]
    send("after", _json({**SIMPLE, "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}}))
    assert done[-1][1].status_code == 200 and json.loads(done[-1][1].json()["text"])["a"] in range(10)
    _wait(lambda: _grammar_stats(service).get("grammar_compiling", 1) == 0, "a compile was left pending")


def test_service_drops_the_compile_of_a_request_whose_client_left(service):
    """A streamed hostile request whose client leaves while it compiles: the compile is killed
    (well before the 15 s limit would), its worker reaped, and no worker burns CPU after."""
    core = service.state.backend.client.core_pid
    before = _grammar_stats(service)
    spec = _json(HOSTILE.replace("16000", "15999"))  # not the timed-out spec (that one fails at once)
    body = _body("left", spec, stream=True)
    # a raw connection: no byte comes back while the grammar compiles, and closing it is the client leaving
    conn = socket.create_connection(("127.0.0.1", service.port))
    conn.sendall(b"POST /v1/generate HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    try:
        _wait(lambda: _grammar_stats(service).get("grammar_running") == 1, "the compile never started")
        running = set(_worker_pids(core))
    finally:
        conn.close()
    _wait(lambda: _grammar_stats(service).get("grammar_abandoned", 0) == before.get("grammar_abandoned", 0) + 1,
          "the compile of the departed request was not dropped")
    stats = _grammar_stats(service)
    assert stats["grammar_running"] == stats["grammar_queued"] == stats["grammar_compiling"] == 0
    assert stats["grammar_timeouts"] == before.get("grammar_timeouts", 0)  # the abort stopped it, not the limit
    _wait(lambda: not all(alive(p) for p in running), "the compiling worker still lives")

    def cpu() -> float:
        total = 0
        for pid in _worker_pids(core):
            with open(f"/proc/{pid}/stat", "rb") as f:
                rest = f.read().rsplit(b")", 1)[1].split()
            total += int(rest[11]) + int(rest[12])
        return total / os.sysconf("SC_CLK_TCK")

    # a replacement may still be importing xgrammar; then every worker is idle
    _wait(lambda: (c := cpu(), time.sleep(1.0), cpu() - c)[-1] < 0.2, "a grammar worker keeps burning CPU")
