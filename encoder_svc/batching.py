"""Cross-request dynamic batching: items of many requests fused into one forward.

A request submits a *job*: ``n`` items (images, video frames, audio windows) of one shape for
one encoder. A single worker thread forms batches: it takes the encoder/shape group whose oldest
item waited longest, waits until that group holds ``max_batch_size`` items or the oldest item's
``max_wait_ms`` deadline (monotonic) passes, runs one forward on up to ``max_batch_size`` items
(possibly from many jobs), checks one output per input and hands each job its rows back.

A batch is not held for its deadline when nothing can join it: requests announce themselves
with ``incoming()`` while they decode, and with none incoming the worker dispatches at once
(sequential traffic pays no batching window; concurrent traffic still fuses).

Failure rules (LitServe's): a bad item never reaches the batcher (decoding happens before);
a job older than ``request_timeout`` when its items come up fails with a timeout; a failed
forward fails every job with an item in that batch; awaiting is bounded, so nothing hangs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextvars
import logging
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from encoder_svc.errors import EncodeError, EncodeTimeout, ForwardFailed
from encoder_svc.metrics import EncoderMetrics

log = logging.getLogger(__name__)

# the monotonic deadline of the request whose items are submitted (None: only request_timeout)
encode_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("encode_deadline", default=None)

RunFn = Callable[[str, torch.Tensor], torch.Tensor]  # (encoder, [B, *in]) -> [B, *out]


@dataclass(frozen=True)
class BatchConfig:
    max_batch_size: int = 16
    max_wait_ms: float = 5.0
    request_timeout: float = 120.0

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_wait_ms < 0 or self.request_timeout <= 0:
            raise ValueError(f"invalid batching config {self}")


@dataclass(eq=False)
class _Job:
    encoder: str
    inputs: torch.Tensor  # [n, *shape]
    created: float
    deadline: float | None = None
    future: cf.Future = field(default_factory=cf.Future)
    outputs: list[torch.Tensor | None] = field(default_factory=list)
    remaining: int = 0

    def __post_init__(self) -> None:
        self.outputs = [None] * len(self.inputs)
        self.remaining = len(self.inputs)

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)

    def put(self, index: int, row: torch.Tensor) -> None:
        """Hand row ``index`` back; the last one resolves the future (or fails it when the rows
        cannot be stacked: the forward broke its contract for this job)."""
        if self.future.done():
            return
        self.outputs[index] = row
        self.remaining -= 1
        if self.remaining == 0:
            try:
                out = torch.stack(self.outputs)  # type: ignore[arg-type]
            except RuntimeError as e:
                self.fail(ForwardFailed(f"the {self.encoder} encoder returned rows of mismatched shapes: {e}"))
                return
            self.future.set_result(out)


class Batcher:
    """One worker thread; ``run`` (async) or ``submit`` (future) from any thread."""

    def __init__(self, cfg: BatchConfig, run_fn: RunFn, metrics: EncoderMetrics | None = None) -> None:
        self.cfg = cfg
        self._run_fn = run_fn
        self._metrics = metrics
        self._cv = threading.Condition()
        self._groups: dict[tuple, deque[tuple[_Job, int, float]]] = {}
        self._stopped = False
        self._incoming = 0  # requests decoding now, whose items may join a waiting batch
        self._thread = threading.Thread(target=self._loop, name="encoder-batcher", daemon=True)
        self._thread.start()

    # -- public -------------------------------------------------------------------------------

    @contextmanager
    def incoming(self) -> Iterator[None]:
        """Hold while preparing items that will be submitted: batches wait for them (up to
        ``max_wait_ms``) instead of leaving without them."""
        with self._cv:
            self._incoming += 1
        try:
            yield
        finally:
            with self._cv:
                self._incoming -= 1
                self._cv.notify()

    def submit(self, encoder: str, inputs: torch.Tensor) -> cf.Future:
        """Queue ``inputs`` [n, *shape]; the future resolves to outputs [n, *out] in order."""
        if inputs.ndim < 1 or len(inputs) == 0:
            raise ValueError("submit needs at least one item")
        now = time.monotonic()
        job = _Job(encoder, inputs, now, encode_deadline.get())
        key = (encoder, tuple(inputs.shape[1:]), inputs.dtype)
        with self._cv:
            if self._stopped:
                raise EncodeError("the encoder is shutting down")
            q = self._groups.setdefault(key, deque())
            q.extend((job, i, now) for i in range(len(inputs)))
            self._cv.notify()
        return job.future

    async def run(self, encoder: str, inputs: torch.Tensor) -> torch.Tensor:
        fut = self.submit(encoder, inputs)
        try:
            # the worker fails jobs past request_timeout; the grace covers a forward in flight
            return await asyncio.wait_for(asyncio.wrap_future(fut), self.cfg.request_timeout + 30.0)
        except asyncio.TimeoutError as e:
            raise EncodeTimeout(f"encoding did not finish within {self.cfg.request_timeout} s") from e
        finally:
            fut.cancel()  # a caller that went away frees its queued items

    async def gather(self, futures: list[cf.Future]) -> list[torch.Tensor]:
        """Await several submitted jobs; the first failure cancels the others."""
        wrapped = [asyncio.wrap_future(f) for f in futures]
        try:
            return list(await asyncio.wait_for(asyncio.gather(*wrapped), self.cfg.request_timeout + 30.0))
        except asyncio.TimeoutError as e:
            raise EncodeTimeout(f"encoding did not finish within {self.cfg.request_timeout} s") from e
        finally:
            for f in futures:
                f.cancel()

    def check_integrity(self) -> None:
        """Queued items belong to live jobs, counts are sane (raises AssertionError)."""
        with self._cv:
            assert self._incoming >= 0, self._incoming
            for (enc, shape, _), q in self._groups.items():
                assert q, f"empty group {enc} {shape} kept"
                for job, i, _ in q:
                    assert 0 <= i < len(job.inputs) and job.outputs[i] is None, (enc, i)

    def pending(self) -> int:
        with self._cv:
            return sum(len(q) for q in self._groups.values())

    def close(self) -> None:
        with self._cv:
            self._stopped = True
            jobs = {job for q in self._groups.values() for job, _, _ in q}
            self._groups.clear()
            self._cv.notify_all()
        for job in jobs:
            job.fail(EncodeError("the encoder is shutting down"))
        self._thread.join(timeout=30)

    # -- worker -------------------------------------------------------------------------------

    def _next_batch(self) -> tuple[tuple, list[tuple[_Job, int, float]]] | None:
        """Block until a batch is due; return (key, items) or None when stopped."""
        wait_s = self.cfg.max_wait_ms / 1000.0
        with self._cv:
            while True:
                if self._stopped:
                    return None
                self._drop_dead()
                if not self._groups:
                    self._cv.wait()
                    continue
                key, q = min(self._groups.items(), key=lambda kv: kv[1][0][2])
                deadline = q[0][2] + wait_s
                now = time.monotonic()
                if len(q) < self.cfg.max_batch_size and now < deadline and self._incoming > 0:
                    self._cv.wait(deadline - now)
                    continue
                items = [q.popleft() for _ in range(min(len(q), self.cfg.max_batch_size))]
                if not q:
                    del self._groups[key]
                return key, items

    def _drop_dead(self) -> None:
        """Forget items of finished/cancelled jobs; time out jobs older than request_timeout."""
        now = time.monotonic()
        for key in list(self._groups):
            q = self._groups[key]
            keep = deque()
            for job, i, t in q:
                if not job.future.done() and now - job.created > self.cfg.request_timeout:
                    job.fail(EncodeTimeout(
                        f"the request waited over request_timeout={self.cfg.request_timeout} s; retry later"))
                elif not job.future.done() and job.deadline is not None and now > job.deadline:
                    if self._metrics is not None:
                        self._metrics.deadline_drops.inc()
                    job.fail(EncodeTimeout("the request's deadline passed while it was queued; dropped"))
                if not job.future.done():
                    keep.append((job, i, t))
            if keep:
                self._groups[key] = keep
            else:
                del self._groups[key]

    def _loop(self) -> None:
        while True:
            got = self._next_batch()
            if got is None:
                return
            (encoder, _, _), items = got
            try:  # nothing here may kill the worker: every later request would hang
                self._run_batch(encoder, items)
            except Exception as e:  # noqa: BLE001 - every job in the batch must hear about it
                log.exception("a %s batch of %d failed outside the forward", encoder, len(items))
                err = ForwardFailed(f"the {encoder} encoder failed on a batch: {type(e).__name__}")
                for job, _, _ in items:
                    job.fail(err)

    def _run_batch(self, encoder: str, items: list[tuple[_Job, int, float]]) -> None:
        now = time.monotonic()
        m = self._metrics
        if m is not None:
            m.batch_size.labels(encoder).observe(len(items))
            for _, _, t in items:
                m.queue_wait.labels(encoder).observe(now - t)
        try:
            x = torch.stack([job.inputs[i] for job, i, _ in items])  # [B, *shape]
            y = self._run_fn(encoder, x)
            if len(y) != len(items):
                raise RuntimeError(f"forward returned {len(y)} outputs for {len(items)} inputs")
        except Exception as e:  # noqa: BLE001 - every job in the batch must hear about it
            log.exception("forward of a %s batch of %d failed", encoder, len(items))
            if m is not None:
                m.forward_errors.labels(encoder).inc()
            err = ForwardFailed(f"the {encoder} encoder failed on a batch: {type(e).__name__}: {e}")
            for job, _, _ in items:
                job.fail(err)
            return
        if m is not None:
            m.forwards.labels(encoder).inc()
            m.forward_items.labels(encoder).inc(len(items))
        for (job, i, _), row in zip(items, y):
            job.put(i, row)
