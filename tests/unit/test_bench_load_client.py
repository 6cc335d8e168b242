"""benchmarks._chat_load's closed-loop driver and client factory, with a fake turn."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks._chat_load import closed_loop, openai_client

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
