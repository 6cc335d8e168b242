"""Batcher unit tests with a known-answer forward (y = 2x + 1)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from encoder_svc.batching import BatchConfig, Batcher
from encoder_svc.errors import EncodeError, EncodeTimeout, ForwardFailed
from encoder_svc.metrics import EncoderMetrics

pytestmark = pytest.mark.unit


class Recorder:
    """Forward y = 2x + 1 that records each batch's shape."""

    def __init__(self, fail_when=None, gate: threading.Event | None = None) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.fail_when = fail_when
        self.gate = gate

    def __call__(self, encoder: str, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            self.gate.wait(10)
        self.calls.append((encoder, tuple(x.shape)))
        if self.fail_when is not None and self.fail_when(x):
            raise RuntimeError("boom")
        return x * 2 + 1


@pytest.fixture
def make():
    made = []

    def _make(run, **kw):
        b = Batcher(BatchConfig(**kw), run, EncoderMetrics())
        made.append(b)
        return b

    yield _make
    for b in made:
        b.close()


def test_config_invariants():
    with pytest.raises(ValueError):
        BatchConfig(max_batch_size=0)
    with pytest.raises(ValueError):
        BatchConfig(request_timeout=0)


def test_jobs_fused_and_split_back_in_order(make):
    rec = Recorder()
    b = make(rec, max_batch_size=16, max_wait_ms=200)
    jobs = [torch.arange(n * 3, dtype=torch.float32).reshape(n, 3) + 100 * k for k, n in enumerate([1, 3, 2, 4])]
    with b.incoming():  # more items are on their way: the batch waits for them
        futs = [b.submit("vision", j) for j in jobs]
    for j, f in zip(jobs, futs):
        torch.testing.assert_close(f.result(5), j * 2 + 1)
    assert sum(s[0] for _, s in rec.calls) == 10
    assert len(rec.calls) == 1, rec.calls  # all ten items arrived within the wait window


def test_max_batch_size_is_respected(make):
    rec = Recorder()
    b = make(rec, max_batch_size=4, max_wait_ms=100)
    out = b.submit("vision", torch.ones(10, 2)).result(5)
    assert out.shape == (10, 2)
    assert sorted(s[0] for _, s in rec.calls) == [2, 4, 4]


def test_shapes_and_encoders_are_not_mixed(make):
    rec = Recorder()
    b = make(rec, max_batch_size=16, max_wait_ms=100)
    f1 = b.submit("vision", torch.ones(2, 3))
    f2 = b.submit("vision", torch.ones(2, 5))
    f3 = b.submit("audio", torch.ones(2, 3))
    assert [f.result(5).shape for f in (f1, f2, f3)] == [(2, 3), (2, 5), (2, 3)]
    assert sorted(rec.calls) == [("audio", (2, 3)), ("vision", (2, 3)), ("vision", (2, 5))]


def test_nothing_incoming_dispatches_without_waiting(make):
    rec = Recorder()
    b = make(rec, max_batch_size=16, max_wait_ms=600_000)
    # a 10-minute window, but no other request is on its way: the lone item must not wait for it
    torch.testing.assert_close(b.submit("vision", torch.ones(1, 2)).result(10), torch.full((1, 2), 3.0))


def test_incoming_requests_hold_the_batch_until_they_submit(make):
    rec = Recorder()
    b = make(rec, max_batch_size=16, max_wait_ms=600_000)
    with b.incoming():
        first = b.submit("vision", torch.ones(1, 2))
        with b.incoming():
            pass  # a request that failed to decode: it leaves without submitting
        time.sleep(0.2)
        assert not first.done() and rec.calls == []
        second = b.submit("vision", torch.zeros(2, 2))
    first.result(10), second.result(10)
    assert rec.calls == [("vision", (3, 2))]
    b.check_integrity()


def test_failed_forward_fails_every_job_in_the_batch_then_recovers(make):
    rec = Recorder(fail_when=lambda x: bool((x < 0).any()))
    b = make(rec, max_batch_size=8, max_wait_ms=200)
    with b.incoming():
        good = b.submit("vision", torch.ones(1, 2))
        bad = b.submit("vision", -torch.ones(1, 2))
    for f in (good, bad):
        with pytest.raises(ForwardFailed, match="boom"):
            f.result(5)
    torch.testing.assert_close(b.submit("vision", torch.zeros(2, 2)).result(5), torch.ones(2, 2))


def test_wrong_output_count_is_an_error_not_a_hang(make):
    b = make(lambda enc, x: x[:-1], max_batch_size=8, max_wait_ms=1)
    with pytest.raises(ForwardFailed, match="outputs for"):
        b.submit("vision", torch.ones(3, 2)).result(5)


def test_request_timeout_while_queued(make):
    gate = threading.Event()
    rec = Recorder(gate=gate)
    b = make(rec, max_batch_size=1, max_wait_ms=0, request_timeout=0.2)
    first = b.submit("vision", torch.ones(1, 2))  # occupies the worker until the gate opens
    time.sleep(0.05)
    second = b.submit("vision", torch.ones(1, 2))
    time.sleep(0.4)
    gate.set()
    first.result(5)
    with pytest.raises(EncodeTimeout, match="request_timeout"):
        second.result(5)


def test_cancelled_job_is_not_run(make):
    gate = threading.Event()
    rec = Recorder(gate=gate)
    b = make(rec, max_batch_size=1, max_wait_ms=0)
    first = b.submit("vision", torch.ones(1, 2))
    time.sleep(0.05)
    cancelled = b.submit("vision", torch.full((1, 2), 7.0))
    assert cancelled.cancel()
    gate.set()
    first.result(5)
    time.sleep(0.1)
    assert len(rec.calls) == 1 and b.pending() == 0


def test_async_run_and_metrics(make):
    m = EncoderMetrics()
    b = Batcher(BatchConfig(max_batch_size=8, max_wait_ms=50), Recorder(), m)
    try:
        async def go():
            with b.incoming():
                runs = [asyncio.ensure_future(b.run("vision", torch.full((1, 2), float(i)))) for i in range(6)]
                await asyncio.sleep(0)  # every run has submitted
            return await asyncio.gather(*runs)

        outs = asyncio.run(go())
        assert [o[0, 0].item() for o in outs] == [2 * i + 1 for i in range(6)]
        assert m.registry.get_sample_value("encoder_forward_items_total", {"encoder": "vision"}) == 6
        passes = m.registry.get_sample_value("encoder_forward_passes_total", {"encoder": "vision"})
        assert 1 <= passes <= 2
        assert m.registry.get_sample_value("encoder_batch_size_count", {"encoder": "vision"}) == passes
    finally:
        b.close()


def test_close_fails_pending_jobs(make):
    gate = threading.Event()
    b = make(Recorder(gate=gate), max_batch_size=1, max_wait_ms=0)
    b.submit("vision", torch.ones(1, 2))
    time.sleep(0.05)
    pending = b.submit("vision", torch.ones(1, 2))
    threading.Timer(0.2, gate.set).start()
    b.close()
    with pytest.raises(EncodeError, match="shutting down"):
        pending.result(5)


def test_a_forward_breaking_its_contract_fails_its_jobs_and_the_worker_lives_on(make):
    """Rows that cannot be stacked (a job's outputs of different shapes) or outputs that are not
    tensors fail those jobs; the worker thread survives and serves the next job."""
    mode = {"bad": "ragged"}

    def run(encoder: str, x: torch.Tensor):
        if mode["bad"] == "ragged":  # row i has i + 1 columns
            return [torch.zeros(i + 1) for i in range(len(x))]
        if mode["bad"] == "not-tensors":
            return [object()] * len(x)
        return x * 2 + 1

    b = make(run, max_batch_size=4, max_wait_ms=0)
    with pytest.raises(ForwardFailed):
        b.submit("vision", torch.ones(2, 3)).result(timeout=5)
    mode["bad"] = "not-tensors"
    with pytest.raises(ForwardFailed):
        b.submit("vision", torch.ones(2, 3)).result(timeout=5)
    mode["bad"] = None
    out = b.submit("vision", torch.ones(2, 3)).result(timeout=5)
    assert torch.equal(out, torch.full((2, 3), 3.0))
    b.check_integrity()


def test_items_whose_deadline_passed_are_dropped_before_their_forward(make):
    from encoder_svc.batching import encode_deadline

    gate = threading.Event()
    rec = Recorder(gate=gate)
    b = make(rec, max_batch_size=1, max_wait_ms=0)
    blocker = b.submit("vision", torch.ones(1, 3))  # holds the worker until the gate opens
    time.sleep(0.05)
    token = encode_deadline.set(time.monotonic() + 0.05)
    try:
        late = b.submit("vision", torch.ones(1, 3))
    finally:
        encode_deadline.reset(token)
    time.sleep(0.1)
    gate.set()
    assert blocker.result(timeout=5).shape == (1, 3)
    with pytest.raises(EncodeTimeout, match="deadline"):
        late.result(timeout=5)
    assert len(rec.calls) == 1  # the late item never reached a forward
    assert b._metrics.deadline_drops._value.get() == 1
    b.check_integrity()
