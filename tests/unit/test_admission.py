"""Admission control: bounded in flight, bounded FIFO queue, 429 past it, nothing leaks."""

from __future__ import annotations

import asyncio
import time

import pytest

from shared.admission import DEADLINE_HEADER, Admission, AdmissionConfig, Overloaded, deadline_from, deadline_header

pytestmark = pytest.mark.unit


def test_in_flight_and_queue_are_bounded_and_slots_pass_in_fifo_order():
    async def go() -> None:
        gate = Admission(AdmissionConfig(max_in_flight=2, max_queue=2, queue_timeout=5), "svc")
        a, b = await gate.acquire(), await gate.acquire()
        order: list[str] = []

        async def waiter(name: str):
            t = await gate.acquire()
            order.append(name)
            return t

        w1 = asyncio.create_task(waiter("first"))
        await asyncio.sleep(0)
        w2 = asyncio.create_task(waiter("second"))
        await asyncio.sleep(0.01)
        assert (gate.in_flight, gate.queued) == (2, 2)
        gate.check_integrity()
        with pytest.raises(Overloaded) as e:
            await gate.acquire()
        assert e.value.retry_after >= 1 and "overloaded" in e.value.message and gate.rejected == 1
        a.release()
        a.release()  # idempotent: must not free a second slot
        t1 = await w1
        assert order == ["first"] and gate.in_flight == 2 and gate.queued == 1
        b.release()
        t2 = await w2
        assert order == ["first", "second"]
        t1.release()
        t2.release()
        assert (gate.in_flight, gate.queued, gate.admitted) == (0, 0, 4)
        gate.check_integrity()

    asyncio.run(go())


def test_queue_timeout_and_cancelled_waiters_leak_nothing():
    async def go() -> None:
        gate = Admission(AdmissionConfig(max_in_flight=1, max_queue=3, queue_timeout=0.05), "svc")
        held = await gate.acquire()
        with pytest.raises(Overloaded):
            await gate.acquire()  # waits 50 ms, then refused
        w = asyncio.create_task(gate.acquire())
        await asyncio.sleep(0.01)
        w.cancel()
        with pytest.raises(asyncio.CancelledError):
            await w
        assert (gate.in_flight, gate.queued) == (1, 0)
        held.release()
        assert gate.in_flight == 0
        again = await gate.acquire()
        again.release()
        gate.check_integrity()

    asyncio.run(go())


def test_deadline_header_round_trip():
    deadline = time.monotonic() + 2.0
    header = deadline_header(deadline)
    ms = int(header[DEADLINE_HEADER])
    assert 1900 <= ms <= 2000
    back = deadline_from(header)
    assert back is not None and abs(back - deadline) < 0.2
    assert deadline_from({}) is None and deadline_from({DEADLINE_HEADER: "junk"}) is None
    assert deadline_header(None) == {}
    assert deadline_header(time.monotonic() - 5) == {DEADLINE_HEADER: "0"}
