"""The engine-core process: loads the model, then loops ``inputs -> Engine.step() -> outputs``.

Started by the front (``llm_svc.core.client.EngineCoreClient``) as
``python -m llm_svc.core.process --epoch N --inputs ADDR --outputs ADDR`` with the service's
settings in ``MMSERVE_LLM_CORE_SETTINGS`` (JSON). It connects a ZMQ PULL socket to ``inputs``
(``CoreAdd`` / ``CoreAbort`` / ``CoreMedia`` / ``CoreShutdown``) and a PUSH socket to ``outputs``
(``CoreReady`` once, then ``CoreOutputs`` every step and at least every ``HEARTBEAT_S`` when
idle: the front's watchdog reads silence as a stalled core). It exits when its parent dies
(``PR_SET_PDEATHSIG``, and a parent-pid check), on ``CoreShutdown``, and with status 3 on
``EngineBroken``.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import time

import msgspec
import zmq

from llm_svc.types.messages import (
    CoreAbort, CoreAdd, CoreFailed, CoreInput, CoreMedia, CoreNeed, CoreOutputs, CoreReady, CoreShutdown, CoreStats,
    CoreToken,
)
from shared.settings import LLMSettings

from llm_svc.types.errors import InvalidRequest

from .ranks import SETTINGS_ENV  # noqa: F401  (the core's settings variable; the client imports it from here)

log = logging.getLogger("llm_svc.core")

HEARTBEAT_S = 0.5
MEDIA_POLL_S = 0.005  # while every request waits for media: block on inputs this long per loop
STATS_EVERY_S = 0.25
EXIT_BROKEN = 3
EXIT_LOAD_FAILED = 2


def core_threads(settings: LLMSettings) -> int:
    """``threads``, or by default every core on the CPU (4 at most beside a GPU). Safe beside the
    front, the gateway and other processes because the core's OpenMP threads soon sleep at
    barriers (``core_env``); with libgomp's default spinning they collapsed as soon as another
    process took a core, which is why this once kept a core free."""
    if settings.threads > 0:
        return settings.threads
    if settings.device.startswith("cuda"):
        return max(1, min(4, os.cpu_count() or 1))
    from ..engine.step_threads import allowed_cpus

    return max(1, allowed_cpus())


def step_threads(settings: LLMSettings):
    """Threads per engine step on the CPU (``llm_svc.engine.step_threads``); None beside a GPU."""
    from ..engine.step_threads import StepThreads

    if settings.device.startswith("cuda"):
        return None
    large = core_threads(settings)
    return StepThreads(large, min(large, settings.small_step_threads or large), settings.small_step_tokens,
                       gemv=settings.gemv_threads or large)


TCMALLOC_PATHS = ("/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                  "/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
                  "/usr/lib64/libtcmalloc_minimal.so.4")


TCMALLOC_CACHE_VAR = "TCMALLOC_MAX_TOTAL_THREAD_CACHE_BYTES"
TCMALLOC_CACHE_BYTES = 4 << 20


def find_tcmalloc() -> str | None:
    return next((p for p in TCMALLOC_PATHS if os.path.exists(p)), None)


def core_env(environ: dict[str, str], malloc: str = "system") -> dict[str, str]:
    """The engine core's environment: ``environ`` with OpenMP threads that spin only briefly at
    a barrier before they sleep (``GOMP_SPINCOUNT=10000``, torch's libgomp), unless the user
    chose a wait policy. It must be set before OpenMP loads, so in the child's environment.
    libgomp's default spin (300,000) made 2 threads 8x slower than 1 beside a 30%-busy other
    process on this 2-core machine (4 x 1,300-token prefills: 73 s; 10,000: 7 s, about what
    sleeping at once gives), while sleeping at once (``OMP_WAIT_POLICY=PASSIVE``) cost 30-40%
    of 2-thread GEMM speed when the machine is quiet (10,000 costs nothing measurable).

    ``malloc="auto"`` preloads tcmalloc (when the system has it and ``LD_PRELOAD`` does not name
    one already): the core allocates and frees many small tensors per step, and glibc's malloc
    cost it about a fifth of its decode speed (``vs_vllm --sweep``, MiMo chat trace, AVX2 box:
    57.9 -> 70.5 output tok/s, ITL p50 35.5 -> 26.5 ms)."""
    env = dict(environ)
    if malloc == "auto" and "tcmalloc" not in env.get("LD_PRELOAD", "") and (lib := find_tcmalloc()):
        env["LD_PRELOAD"] = f"{lib}:{env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else lib
        # tcmalloc's per-thread caches may grow to 32 MiB in all, and they fill slowly: the core's
        # RSS rose ~3% per 30 min through a 3-minute soak (steps of ~0.3 MB) and flattened only
        # within the hour; capped at 4 MiB, 0.56% (its later half 0.04%), at the same request rate
        env.setdefault(TCMALLOC_CACHE_VAR, str(TCMALLOC_CACHE_BYTES))
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return env
    return {**env, "GOMP_SPINCOUNT": "10000"}


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when the front dies, so a crashed front never leaves a core behind."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)


class CoreLoop:
    """One core's loop over an ``Engine``; ``run`` returns on shutdown."""

    def __init__(self, engine, inputs: zmq.Socket, outputs: zmq.Socket, epoch: int, parent: int,
                 media_dtype, kv_keys=None, roles=None):
        from .roles import RoleDriver

        self.engine = engine
        # how the engine steps for this replica's role (prefill / decode / both: docs/disagg.md)
        self.roles = roles if roles is not None else RoleDriver(engine)
        self.kv_keys = kv_keys  # llm_svc.kv.events.KVKeyTracker when KV events are published
        self.inputs, self.outputs = inputs, outputs
        self.epoch, self.parent = epoch, parent
        self._dec = msgspec.msgpack.Decoder(CoreInput)
        self._enc = msgspec.msgpack.Encoder()
        self._device = engine.runner.device
        self._media_dtype = media_dtype  # media embeddings are cast to the model's dtype
        self._stop = False
        self._last_send = 0.0
        self._last_stats = 0.0

    def run(self) -> None:
        while not self._stop:
            idle = not self.roles.has_work()
            wait = HEARTBEAT_S if idle else MEDIA_POLL_S if self.engine.stalled() or (
                self.roles.busy() and not self.engine.has_work()) else 0.0
            if self.inputs.poll(int(wait * 1000)):
                self._drain()
            outs = self.roles.step() if self.roles.has_work() else []
            self._send(outs, self.engine.take_needs())
            if idle and os.getppid() != self.parent:
                log.warning("the front process is gone; core exiting")
                return

    def _drain(self) -> None:
        pending: list[CoreToken] = []
        while True:
            try:
                frame = self.inputs.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                msg = self._dec.decode(frame)
            except msgspec.DecodeError:
                log.exception("dropping an undecodable core input")
                continue
            if msg.epoch != self.epoch:
                continue  # queued for a core that no longer exists
            if isinstance(msg, CoreAdd):
                self._add(msg, pending)
            elif isinstance(msg, CoreAbort):
                for rid in msg.request_ids:
                    if not self.roles.abort(rid):
                        self.engine.abort(rid)
                    if self.kv_keys is not None:
                        self.kv_keys.settle(rid)
            elif isinstance(msg, CoreMedia):
                self._media(msg, pending)
            elif isinstance(msg, CoreShutdown):
                self._stop = True
        if pending:
            self._send(pending)

    def _add(self, msg: CoreAdd, pending: list[CoreToken]) -> None:
        from .convert import request_from_core

        try:
            req = request_from_core(msg, self._device, self._media_dtype, self.engine.eos_token_ids)
            self.roles.add(req, msg.remote)
            if self.kv_keys is not None and msg.router_keys:
                self.kv_keys.expect(msg.request_id, req.prompt_keys, [tuple(a) for a in msg.router_keys])
        except InvalidRequest as e:
            pending.append(CoreToken(msg.request_id, error=e.message, status=400, code=e.code))
        except Exception as e:  # a bad item never fails other requests
            log.exception("could not add request %s", msg.request_id)
            pending.append(CoreToken(msg.request_id, error=f"the request could not be started: {e}", status=400))

    def _media(self, msg: CoreMedia, pending: list[CoreToken]) -> None:
        from .convert import tensor_from_wire

        try:
            items = {i: tensor_from_wire(t).to(device=self._device, dtype=self._media_dtype) for i, t in msg.items}
            self.engine.provide_media(msg.request_id, items)
        except (InvalidRequest, ValueError) as e:
            self.engine.abort(msg.request_id)
            pending.append(CoreToken(msg.request_id, error=str(getattr(e, "message", e)), status=400))

    def _send(self, outs: list[CoreToken], needs: list[CoreNeed] = ()) -> None:
        now = time.monotonic()
        stats = None
        # stats ride along a few times a second, and with every finish: /metrics read right
        # after a response then never shows that request as running
        finished = [t.request_id for t in outs if t.finish_reason is not None or t.error is not None]
        if finished or now - self._last_stats >= STATS_EVERY_S:
            self._last_stats = now
            stats = self._stats()
        stored, removed = self._kv_events(finished)
        if not outs and not needs and stats is None and not stored and not removed \
                and now - self._last_send < HEARTBEAT_S:
            return
        self._last_send = now
        self.outputs.send(self._enc.encode(CoreOutputs(self.epoch, outs, stats, list(needs), stored, removed)),
                          copy=False)

    def _kv_events(self, finished: list[str]) -> tuple[list[int], list[int]]:
        if self.kv_keys is None:
            return [], []
        for rid in finished:
            self.kv_keys.settle(rid)
        return self.kv_keys.poll()

    def _stats(self) -> CoreStats:
        s = self.engine.stats()
        s.update(self.roles.stats())
        return CoreStats(
            running=int(s["running"]), waiting=int(s["waiting"]),
            kv_full_usage=1.0 - s["full_free"] / s["full_total"], kv_swa_usage=1.0 - s["swa_free"] / s["swa_total"],
            prefix_hit_tokens=int(s["cached_tokens"]), steps=int(s["steps"]),
            tiers={k: float(v) for k, v in s.items() if k.startswith(TIER_STAT_PREFIXES)},
        )


TIER_STAT_PREFIXES = ("host_", "l3_", "tree_", "prefetching", "spec_", "grammar_", "handover_")


def _start_ranks(settings: LLMSettings, par, outputs: zmq.Socket, enc, epoch: int):
    """Spawn ranks 1..N-1 and join their group as rank 0: ``(RankWorkers, RankGroup, rank 0's device)``.
    A rank that exits ends this process: before ready as a load failure the front reports,
    after it as a broken group the front restarts (``ranks.RankWorkers.watch``)."""
    from .ranks import start_group

    return start_group(settings, par, watch=lambda rank, code: outputs.send(enc.encode(CoreFailed(
        epoch, f"tensor-parallel rank {rank} exited with {code} while the group loaded (its log says why)"))))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--epoch", type=int, required=True)
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--outputs", required=True)
    ap.add_argument("--parent", type=int, default=os.getppid())
    args = ap.parse_args(argv)
    _die_with_parent(args.parent)
    settings = LLMSettings.model_validate_json(os.environ[SETTINGS_ENV])
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s core %(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    outputs = ctx.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 2000)
    outputs.connect(args.outputs)
    inputs = ctx.socket(zmq.PULL)
    inputs.setsockopt(zmq.LINGER, 0)
    inputs.connect(args.inputs)
    enc = msgspec.msgpack.Encoder()
    workers, group = None, None
    try:
        from llm_svc.loading.loader import load_lm
        from llm_svc.parallel import SINGLE, ParallelConfig
        from .build import build_engine

        import torch

        par = ParallelConfig.of(settings)
        device = settings.device
        group = SINGLE
        if par.world_size > 1:
            workers, group, device = _start_ranks(settings, par, outputs, enc, args.epoch)
        torch.set_num_threads(core_threads(settings))
        from ..models import cpu_gemv

        cpu_gemv.set_threads(settings.gemv_threads or core_threads(settings))  # few-row linears: every core
        from ..attention import cpu_paged

        cpu_paged.set_threads(core_threads(settings))  # long decode attention: every core
        t0 = time.perf_counter()
        lm = load_lm(settings.model_dir, device, settings.dtype, parallel=par, group=group)
        if group.world > 1:
            log.info("rank 0 loaded its share in %.2f s", time.perf_counter() - t0)
        engine = build_engine(settings, lm, threads=step_threads(settings), group=group)
    except Exception as e:
        log.exception("engine core failed to load")
        if workers is not None:
            workers.stop(0.0)
        outputs.send(enc.encode(CoreFailed(args.epoch, f"{type(e).__name__}: {e}")))
        inputs.close()
        outputs.close()
        ctx.term()
        return EXIT_LOAD_FAILED
    kv_keys = None
    if settings.kv_events_url and settings.enable_prefix_cache:
        from ..kv.events import KVKeyTracker

        kv_keys = KVKeyTracker(engine.scheduler.kv.tree, settings.swa_retention_interval, settings.kv_events_keys)
    try:
        from .build import model_identity
        from .roles import RoleDriver

        roles = RoleDriver(engine, settings, model_identity(settings.model_dir) if settings.role != "both" else "")
    except Exception as e:  # e.g. the hand-over port is taken
        log.exception("engine core could not take its role")
        outputs.send(enc.encode(CoreFailed(args.epoch, f"role {settings.role}: {type(e).__name__}: {e}")))
        inputs.close()
        outputs.close()
        ctx.term()
        return EXIT_LOAD_FAILED
    loop = CoreLoop(engine, inputs, outputs, args.epoch, args.parent, lm.dtype, kv_keys, roles)
    r = engine.runner
    outputs.send(enc.encode(CoreReady(args.epoch, os.getpid(), r.num_full_slots, r.num_swa_slots,
                                      engine.scheduler.config.window, r.kv_bytes(), roles.handover_port)))
    log.info("engine core %d ready (epoch %d): %d full / %d swa slots", os.getpid(), args.epoch,
             r.num_full_slots, r.num_swa_slots)
    if workers is not None:
        workers.ready = True
    from shared.memtrace import maybe_start

    maybe_start("llm-core")  # MMSERVE_TRACEMALLOC=1 only
    from shared.gc_tuning import freeze_startup_heap

    freeze_startup_heap(f"engine core {os.getpid()}")  # a full collection of the loaded model stalled steps
    code = 0
    try:
        loop.run()
    except Exception:
        log.exception("engine core broken; exiting so the front restarts it")
        code = EXIT_BROKEN
    roles.close()
    if engine.grammars is not None:  # its compile workers are killed and reaped (they die with us anyway)
        engine.grammars.close()
    if workers is not None:
        if code == 0:
            engine.runner.stop()
        workers.stop()
    inputs.close()
    outputs.close()
    ctx.term()
    return code


if __name__ == "__main__":
    sys.exit(main())
