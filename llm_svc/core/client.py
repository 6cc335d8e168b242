"""The front's side of the engine core: spawns and supervises the core process, sends it
requests, and turns its token outputs into text for each request's ``RequestStream``.

Supervision (a watchdog task on the front's event loop, never blocked by engine work):

* the core exits (crash, OOM kill, ``EngineBroken``), or a busy core sends nothing for
  ``core_stall_timeout`` seconds (it stopped stepping): the core is killed, every in-flight
  request fails at once with a 503 error, ``ready`` turns False, and a new core is started
  after a backoff (0.5 s doubling to ``core_max_backoff``; reset once a core has served 60 s);
* the first core failing to load is fatal (``start`` raises: the service reports the error,
  as before); a restarted one failing to load is retried with the backoff.

Request ids: the core knows each request by an id of its own (the client's ``request_id``
plus ``@`` and a per-front counter). A client may reuse an id once its request has ended
(the gateway re-sends a request by value under the same id when its media by reference was
gone); the abort of the earlier request can still be on its way to the core, and must not
end the new one, nor may a late output of the earlier one reach it (vLLM's engine also keys
requests by internal ids for this reason).

Each core epoch gets its own pair of ZMQ sockets on fresh abstract-namespace IPC addresses
(no files to leak): nothing sent to a dead core can reach its successor.

Media by reference: a request's items known by key only are sent without tensors; when the
core's admission finds a span past the cached prefix that needs one it sends a ``CoreNeed``,
and the front fetches (``media``: an ``EmbeddingFetcher``, single flight per key) on its event
loop and answers a ``CoreMedia``. A fetch that fails ends the request with 409
``media_unavailable`` (and aborts it in the core).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from llm_svc.types.messages import (
    CoreAbort, CoreFailed, CoreMedia, CoreNeed, CoreOutput, CoreOutputs, CoreReady, CoreShutdown, CoreStats, CoreToken,
)
from shared.settings import LLMSettings

from llm_svc.types.request import BackendStats, RequestStream
from llm_svc.types.errors import InvalidRequest
from llm_svc.types.request import PreparedRequest
from llm_svc.core.media_fetch import MediaUnavailable
from .convert import tensor_to_wire, to_core_add
from .output import OutputProcessor
from .process import SETTINGS_ENV, core_env

log = logging.getLogger(__name__)

HEALTHY_RESET_S = 60.0
WATCH_S = 0.1


class CoreStartError(RuntimeError):
    """The first engine core could not start (the message says why)."""


@dataclass
class _Core:
    """One core process of one epoch and its sockets."""

    epoch: int
    proc: subprocess.Popen
    inputs: zmq.Socket  # sync PUSH (front -> core)
    outputs: zmq.asyncio.Socket  # PULL (core -> front)
    started: float = field(default_factory=time.monotonic)
    ready_at: float | None = None
    last_msg: float = field(default_factory=time.monotonic)
    failed: str | None = None  # what its CoreFailed said


class EngineCoreClient:
    def __init__(self, settings: LLMSettings, tokenizer):
        self.settings = settings
        self.tokenizer = tokenizer
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(CoreOutput)
        self._reqs = OutputProcessor(tokenizer)
        self._core: _Core | None = None
        self._epoch = 0
        self._tasks: set[asyncio.Task] = set()
        self._closing = False
        self._backoff = 0.5
        self._first = asyncio.Event()
        self.ready = False
        self.detail: str | None = "starting the engine core"
        self.restarts = 0
        self.capacity: CoreReady | None = None
        self.core_stats = CoreStats()
        self.media = None  # an EmbeddingFetcher (llm_svc.core.media_fetch), set before requests by reference
        self.kv_events = None  # a KVPublisher (llm_svc.front.kv_publish) when KV events are published
        self._refs: dict[str, tuple[int, set[int]]] = {}  # core id -> (items by reference, items needed)
        self._core_ids: dict[str, str] = {}  # client request_id -> core id, while in flight
        self._seq = itertools.count()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the first core and wait until it serves; raises ``CoreStartError`` if it cannot."""
        self._spawn()
        self._task(self._watch())
        await self._first.wait()
        if not self.ready:
            err = self.detail or "the engine core exited during start-up"
            await self.close()
            raise CoreStartError(err)

    async def close(self) -> None:
        self._closing = True
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(BaseException):
                await t
        core, self._core = self._core, None
        if core is not None:
            await asyncio.to_thread(self._stop_core, core, graceful=True)
        self._fail_all("the LLM service is shutting down", 503)
        self._sync_ctx.term()
        self._async_ctx.term()

    @property
    def core_pid(self) -> int | None:
        return self._core.proc.pid if self._core is not None else None

    # ------------------------------------------------------------------ requests
    def submit(self, prep: PreparedRequest) -> RequestStream:
        """Send a request to the core (its id not in flight: the routes refuse a duplicate); raises
        ``InvalidRequest`` while the core restarts. What the core refuses (a request that can never
        fit its KV pools) ends the stream with that error."""
        if not self.ready or self._core is None:
            raise InvalidRequest("the engine core is restarting; retry shortly", code="engine_unavailable")
        stream = RequestStream(prep.request_id, asyncio.get_running_loop(), loop_fed=True)
        core_id = f"{prep.request_id}@{next(self._seq)}"
        self._core_ids[prep.request_id] = core_id
        self._reqs.add(prep, stream, key=core_id)
        by_ref = len(prep.unresolved())
        if by_ref:
            self._refs[core_id] = (by_ref, set())
        self._send(to_core_add(prep, self._core.epoch, core_id))
        return stream

    def abort(self, request_id: str) -> None:
        """The stream ends with ``finish_reason="abort"`` once the core confirms."""
        core_id = self._core_ids.get(request_id)
        if core_id is not None and core_id in self._reqs and self._core is not None:
            self._send(CoreAbort(self._core.epoch, [core_id]))

    def stats(self) -> BackendStats:
        s = self.core_stats
        return BackendStats(running=s.running, waiting=s.waiting, kv_full_usage=s.kv_full_usage,
                            kv_swa_usage=s.kv_swa_usage, prefix_hit_tokens=s.prefix_hit_tokens,
                            tiers=dict(s.tiers))

    @property
    def num_in_flight(self) -> int:
        return len(self._reqs)

    def _send(self, msg) -> None:
        try:
            self._core.inputs.send(self._enc.encode(msg), zmq.NOBLOCK, copy=False)
        except zmq.Again:  # no connected core (it is dying): the watchdog fails the requests
            log.warning("engine core not connected; dropped a %s", type(msg).__name__)

    # ------------------------------------------------------------------ outputs
    def _on_outputs(self, msg: CoreOutputs) -> None:
        if msg.stats is not None:
            self.core_stats = msg.stats
        for t in msg.outputs:
            self._on_token(t)
        for need in msg.needs:
            self._task(self._fetch(msg.epoch, need))
        if self.kv_events is not None and (msg.kv_stored or msg.kv_removed):
            self.kv_events.apply(msg.kv_stored, msg.kv_removed)

    def _on_token(self, t: CoreToken) -> None:
        if self._reqs.process(t):
            self._send(CoreAbort(self._core.epoch, [t.request_id]))
        if t.request_id not in self._reqs:
            self._ended(t.request_id)

    def _ended(self, rid: str) -> None:
        """Core request ``rid`` is over here (finished, failed, or a late output of one that was)."""
        client_id = rid.rpartition("@")[0]
        if self._core_ids.get(client_id) == rid:
            del self._core_ids[client_id]
        refs = self._refs.pop(rid, None)
        if refs is not None and self.media is not None:
            self.media.count_skipped(refs[0] - len(refs[1]))

    async def _fetch(self, epoch: int, need: CoreNeed) -> None:
        """Fetch what the core's admission asked for and send it in (or fail the request)."""
        rid = need.request_id
        prep = self._reqs.prep(rid)
        if prep is None:
            return  # ended meanwhile
        if rid in self._refs:
            self._refs[rid][1].update(need.items)
        try:
            if self.media is None:
                raise MediaUnavailable("this LLM replica cannot fetch media sent by reference")
            refs = {i: prep.mm_refs[i] for i in need.items}
            if any(r is None for r in refs.values()):
                raise MediaUnavailable(f"the core asked for media items {need.items} not sent by reference")
            got = await self.media.fetch_many(refs)
        except MediaUnavailable as e:
            self._fail_one(epoch, rid, e.message, e.status, e.code)
            return
        except Exception as e:  # a bug here must not leave the request waiting for its deadline
            log.exception("fetching the media of %s failed", rid)
            self._fail_one(epoch, rid, f"fetching the request's media failed ({type(e).__name__}); retry it", 500)
            return
        if self._core is None or self._core.epoch != epoch or rid not in self._reqs:
            return
        self._send(CoreMedia(epoch, rid, [(i, tensor_to_wire(t)) for i, t in got.items()]))

    def _fail_one(self, epoch: int, rid: str, message: str, status: int, code: str | None = None) -> None:
        if self._reqs.fail(rid, message, status, code):
            self._ended(rid)
            if self._core is not None and self._core.epoch == epoch:
                self._send(CoreAbort(epoch, [rid]))

    def _fail_all(self, message: str, status: int) -> None:
        self._reqs.fail_all(message, status)
        for rid in list(self._refs):
            self._ended(rid)
        self._core_ids.clear()

    async def _read(self, core: _Core) -> None:
        """Receive one core's messages until its sockets close."""
        while True:
            try:
                frame = await core.outputs.recv()
            except zmq.ZMQError:  # its sockets were closed: that core is gone
                return
            core.last_msg = time.monotonic()
            try:
                msg = self._dec.decode(frame)
            except msgspec.DecodeError:
                log.exception("undecodable message from the engine core")
                continue
            if msg.epoch != core.epoch or core is not self._core:
                continue
            if isinstance(msg, CoreOutputs):
                self._on_outputs(msg)
            elif isinstance(msg, CoreReady):
                core.ready_at = time.monotonic()
                self.capacity = msg
                self.ready, self.detail = True, None
                self._first.set()
                log.info("engine core %d serving (epoch %d)", msg.pid, msg.epoch)
            elif isinstance(msg, CoreFailed):
                core.failed = msg.error
                self.detail = f"the engine core failed to start: {msg.error}"

    # ------------------------------------------------------------------ supervision
    def _spawn(self) -> None:
        self._epoch += 1
        tag = f"mmserve-llm-{os.getpid()}-{self._epoch}-{secrets.token_hex(4)}"
        in_addr, out_addr = f"ipc://@{tag}-in", f"ipc://@{tag}-out"
        inputs = self._sync_ctx.socket(zmq.PUSH)
        inputs.setsockopt(zmq.SNDHWM, 0)
        inputs.setsockopt(zmq.LINGER, 0)
        inputs.bind(in_addr)
        outputs = self._async_ctx.socket(zmq.PULL)
        outputs.setsockopt(zmq.RCVHWM, 0)
        outputs.setsockopt(zmq.LINGER, 0)
        outputs.bind(out_addr)
        env = {**core_env(dict(os.environ), self.settings.core_malloc), SETTINGS_ENV: self.settings.model_dump_json()}
        proc = subprocess.Popen(
            [sys.executable, "-m", "llm_svc.core.process", "--epoch", str(self._epoch), "--inputs", in_addr,
             "--outputs", out_addr, "--parent", str(os.getpid())], env=env,
            # its own process group: a SIGTERM/Ctrl-C meant for the service (``kill -- -PGID``, a
            # terminal) must not kill the core first, or the watchdog restarts it during shutdown;
            # the front stops it with CoreShutdown, and PR_SET_PDEATHSIG if the front dies
            start_new_session=True)
        self._core = _Core(self._epoch, proc, inputs, outputs)
        self._task(self._read(self._core))
        log.info("started engine core pid %d (epoch %d)", proc.pid, self._epoch)

    async def _watch(self) -> None:
        s = self.settings
        while not self._closing:
            await asyncio.sleep(WATCH_S)
            core = self._core
            if core is None:
                continue
            now = time.monotonic()
            code = core.proc.poll()
            if code is not None:
                why = core.failed or f"exited with code {code}"
                await self._on_death(core, f"the engine core {why}")
            elif core.ready_at is None and now - core.started > s.core_start_timeout:
                await self._on_death(core, f"the engine core did not start within {s.core_start_timeout:g} s")
            elif core.ready_at is not None and self._reqs and now - core.last_msg > s.core_stall_timeout:
                await self._on_death(core, f"the engine core stopped stepping (silent for {s.core_stall_timeout:g} s)")
            elif core.ready_at is not None and now - core.ready_at > HEALTHY_RESET_S:
                self._backoff = 0.5

    async def _on_death(self, core: _Core, why: str) -> None:
        self.ready = False
        first = not self._first.is_set()
        self.detail = why + ("" if first else "; restarting it")
        log.error("%s", self.detail)
        self._core = None
        if self.kv_events is not None:
            self.kv_events.reset()  # the next core starts with an empty prefix tree
        await asyncio.to_thread(self._stop_core, core, graceful=False)
        self._fail_all(f"{why}; the request was not completed, retry it", 503)
        if first:  # a model that does not load at all: report it, do not loop
            self._first.set()
            self._closing = True
            return
        delay, self._backoff = self._backoff, min(2 * self._backoff, self.settings.core_max_backoff)
        await asyncio.sleep(delay)
        if not self._closing:
            self.restarts += 1
            self._spawn()

    def _stop_core(self, core: _Core, graceful: bool) -> None:
        """Stop ``core``'s process (blocking; call off the loop) and close its sockets."""
        p = core.proc
        if graceful and p.poll() is None:
            with contextlib.suppress(zmq.ZMQError):
                core.inputs.send(self._enc.encode(CoreShutdown(core.epoch)), zmq.NOBLOCK)
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGTERM)
        if p.poll() is None:
            try:
                p.wait(1 if graceful else 0.01)
            except subprocess.TimeoutExpired:
                p.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(10)
        core.inputs.close(0)
        core.outputs.close(0)

    def _task(self, coro) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
