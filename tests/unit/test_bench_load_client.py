"""benchmarks._chat_load's load driver (``drive``, ``closed_loop``) and client factories, with fake
requests: what is sent, in which order, how many at once, and what comes back."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from benchmarks._chat_load import Item, closed_loop, drive, http_client, one_request, openai_client

pytestmark = pytest.mark.unit


def test_closed_loop_runs_each_worker_turn_after_turn_until_done():
    seen: list[tuple[int, int]] = []
    in_flight = {k: 0 for k in range(3)}

    async def turn(k: int, i: int) -> None:
        in_flight[k] += 1
        assert in_flight[k] == 1  # a worker's next turn starts only when its last one ended
        await asyncio.sleep(0)
        seen.append((k, i))
        in_flight[k] -= 1

    asyncio.run(closed_loop(3, turn, lambda: len(seen) >= 9))
    for k in range(3):
        turns = [i for w, i in seen if w == k]
        assert turns == list(range(len(turns))) and turns  # each worker counts its own turns from 0
    assert len(seen) >= 9


def test_closed_loop_done_at_start_sends_nothing():
    async def turn(k: int, i: int) -> None:
        raise AssertionError("no turn expected")

    asyncio.run(closed_loop(4, turn, lambda: True))


def test_openai_client_points_at_v1_without_retries():
    c = openai_client("http://127.0.0.1:9", timeout=12)
    assert str(c.base_url).rstrip("/") == "http://127.0.0.1:9/v1" and c.max_retries == 0 and c.timeout == 12


def _fake_send(log: list, delays: dict[int, int] | None = None):
    """A request i that yields ``delays[i]`` times (default 1) and returns i * 10; ``log`` gets
    ("start", i, in flight) and ("end", i)."""
    state = {"in_flight": 0}

    async def send(i: int) -> int:
        state["in_flight"] += 1
        log.append(("start", i, state["in_flight"]))
        for _ in range((delays or {}).get(i, 1)):
            await asyncio.sleep(0)
        state["in_flight"] -= 1
        log.append(("end", i))
        return i * 10

    return send


def test_drive_returns_every_result_in_request_order_and_a_wall_time():
    log: list = []
    results, wall = asyncio.run(drive(5, _fake_send(log, {0: 5, 1: 1, 2: 3, 3: 0, 4: 2}), concurrency=2))
    assert results == [0, 10, 20, 30, 40] and wall >= 0
    assert sorted(e[1] for e in log if e[0] == "start") == [0, 1, 2, 3, 4]  # each request sent once


def test_drive_caps_requests_in_flight_and_starts_them_in_order():
    log: list = []
    asyncio.run(drive(7, _fake_send(log, {i: i % 3 + 1 for i in range(7)}), concurrency=3))
    starts = [e for e in log if e[0] == "start"]
    assert [e[1] for e in starts] == list(range(7))
    assert max(e[2] for e in starts) == 3  # the cap is reached and never passed


def test_drive_refills_a_slot_as_soon_as_a_request_ends():
    log: list = []
    asyncio.run(drive(3, _fake_send(log, {0: 10, 1: 1, 2: 1}), concurrency=2))
    # request 1 ends while 0 is still running: 2 starts next, before 0 ends
    assert log.index(("start", 2, 2)) < log.index(("end", 0))


def test_drive_without_a_cap_sends_everything_at_once():
    log: list = []
    asyncio.run(drive(4, _fake_send(log)))
    assert [e[2] for e in log if e[0] == "start"] == [1, 2, 3, 4]


def test_drive_with_no_requests_sends_nothing():
    assert asyncio.run(drive(0, _fake_send([]), concurrency=4))[0] == []
    assert asyncio.run(drive(0, _fake_send([]), arrivals=[]))[0] == []


def test_drive_open_loop_sends_at_the_arrival_times_whatever_is_in_flight():
    log: list = []
    sent_at: dict[int, float] = {}
    loop_t0: list[float] = []

    async def send(i: int) -> int:
        sent_at[i] = asyncio.get_running_loop().time() - loop_t0[0]
        log.append(("start", i))
        await asyncio.sleep(0.2)  # longer than the gaps: an open loop does not wait for answers
        log.append(("end", i))
        return i

    async def main():
        loop_t0.append(asyncio.get_running_loop().time())
        return await drive(3, send, arrivals=[0.0, 0.05, 0.1])

    results, wall = asyncio.run(main())
    assert results == [0, 1, 2]
    assert [e[1] for e in log if e[0] == "start"] == [0, 1, 2]
    assert log.index(("start", 2)) < log.index(("end", 0))  # sent while 0 was still in flight
    assert sent_at[1] >= 0.05 - 0.01 and sent_at[2] >= 0.1 - 0.01  # not before its time


def test_drive_open_loop_with_a_cap_makes_late_arrivals_wait_for_a_slot():
    log: list = []
    asyncio.run(drive(4, _fake_send(log, {i: 3 for i in range(4)}), concurrency=1, arrivals=[0, 0, 0, 0]))
    assert max(e[2] for e in log if e[0] == "start") == 1


def test_drive_refuses_a_bad_plan():
    with pytest.raises(ValueError):
        asyncio.run(drive(3, _fake_send([]), arrivals=[0.0]))
    with pytest.raises(ValueError):
        asyncio.run(drive(3, _fake_send([]), concurrency=0))


def test_drive_passes_an_exception_of_a_request_on():
    async def send(i: int) -> int:
        if i == 1:
            raise RuntimeError("boom")
        return i

    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(drive(3, send, concurrency=2))


def test_http_client_sends_relative_to_the_server_url():
    async def main():
        async with http_client("http://127.0.0.1:9", timeout=7, max_connections=3) as c:
            return c.build_request("POST", "/v1/encode", params={"modality": "image"}), c.timeout

    req, timeout = asyncio.run(main())
    assert str(req.url) == "http://127.0.0.1:9/v1/encode?modality=image" and timeout.read == 7


def _sse(*events: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def _chunk(content: str | None = None, usage: dict | None = None) -> dict:
    choices = [] if content is None else [{"index": 0, "delta": {"content": content}, "finish_reason": None}]
    return {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": choices,
            "usage": usage}


def _fake_openai(handler) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://fake/v1", api_key="unused", max_retries=0,
                              http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))


def test_one_request_streams_and_reads_the_usage_chunk():
    sent: list[dict] = []

    def handler(req: httpx.Request) -> httpx.Response:
        sent.append(json.loads(req.content))
        usage = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12,
                 "prompt_tokens_details": {"cached_tokens": 4}}
        body = _sse(_chunk("a"), _chunk("b"), _chunk(""), _chunk("c"), _chunk(usage=usage))
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    rec = asyncio.run(one_request(_fake_openai(handler), "m", Item("hi", 1, 3)))
    assert rec.error is None and rec.usage and rec.text == "abc"
    assert (rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens, rec.max_tokens) == (9, 3, 4, 3)
    assert rec.ttft is not None and len(rec.gaps) == 2  # one gap per content chunk after the first
    (body,) = sent
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["max_tokens"] == 3
    assert body["stream"] is True and body["temperature"] == 0 and body["ignore_eos"] is True


def test_one_request_without_ignore_eos_sends_no_such_field_and_notes_a_missing_usage_chunk():
    sent: list[dict] = []

    def handler(req: httpx.Request) -> httpx.Response:
        sent.append(json.loads(req.content))
        return httpx.Response(200, content=_sse(_chunk("x")), headers={"content-type": "text/event-stream"})

    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    rec = asyncio.run(one_request(_fake_openai(handler), "m", msgs, 5, ignore_eos=False))
    assert rec.error is None and not rec.usage and rec.text == "x" and rec.cached_tokens is None
    assert "ignore_eos" not in sent[0] and sent[0]["messages"] == msgs and sent[0]["max_tokens"] == 5


def test_one_request_records_an_api_error_instead_of_raising():
    rec = asyncio.run(one_request(_fake_openai(lambda req: httpx.Response(503, json={"error": "busy"})), "m",
                                  Item("hi", 1, 2)))
    assert rec.error and rec.error.startswith("InternalServerError") and rec.text == "" and not rec.usage
