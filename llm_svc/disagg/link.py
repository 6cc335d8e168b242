"""The engine core's side of the hand-over transport: an asyncio loop on its own thread beside
the step loop, so that a send or a receive never holds a step.

* A prefill core calls ``send(host, port, handover)``: a ``concurrent.futures.Future`` that is
  done when every byte went out (or failed, or passed ``timeout_s``); one connection a send.
* A decode core listens (``listen=(host, port)``); each hand-over that arrives is kept under
  its request id until a request claims it (``take``) or ``ttl_s`` passes (``expire``, counted).
  A hand-over that did not arrive whole is kept as it came: the decode side's ``check`` names
  its defect and the request recomputes.

The step loop only calls the thread-safe methods here; nothing in this file touches the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import Counter

from llm_svc.disagg.messages import Handover
from llm_svc.disagg.nixl_agent import NixlEndpoint, nixl_available
from llm_svc.disagg.transport import (MAX_HANDOVER_BYTES, NIXL, ConnectionGate, TcpReceiver, TcpSender,
                                      TransferError)

log = logging.getLogger(__name__)


def resolve_transport(name: str) -> str:
    """``tcp`` or ``nixl`` for the ``kv_transport`` setting: ``auto`` is ``nixl`` where NIXL is
    installed; ``nixl`` without it raises (the service refuses to start, saying what to install)."""
    if name == "auto":
        return "nixl" if nixl_available() else "tcp"
    if name == "nixl" and not nixl_available():
        raise RuntimeError("kv_transport=nixl but NIXL is not installed: pip install nixl-cu13 "
                           "(or the nixl package on a CUDA host), or set kv_transport=tcp")
    return name


class HandoverLink:
    """``listen``: (host, port) to receive on (port 0: a free one, then ``port`` says which);
    None for a replica that only sends. ``key``: the services' shared token, which both ends of a
    hand-over prove they hold (``transport``'s challenge). ``transport``: ``tcp`` (the pages on
    the stream) or ``nixl`` (by NIXL where the peer has it too, else on the stream)."""

    def __init__(self, listen: tuple[str, int] | None = None, timeout_s: float = 10.0, ttl_s: float = 60.0,
                 max_bytes: int = MAX_HANDOVER_BYTES, key: bytes = b"", transport: str = "tcp",
                 pool_bytes: int = 1 << 30, max_connections: int = 64) -> None:
        """``pool_bytes``: with NIXL, the receive buffers kept registered for reuse;
        ``max_connections``: the most hand-over connections received at once (each cut after
        ``timeout_s`` without a byte)."""
        self.timeout_s, self.ttl_s = timeout_s, ttl_s
        self._key = key
        self.transport = resolve_transport(transport)
        self._nixl = NixlEndpoint(pool_bytes) if self.transport == "nixl" else None
        self.port = 0
        self.stats: Counter[str] = Counter()  # handover_* counters (the core's stats carry them)
        self._arrived: dict[str, tuple[Handover, float]] = {}
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="handover-link", daemon=True)
        self._thread.start()
        self._receiver: TcpReceiver | None = None
        self._task = None
        if listen is not None:
            gate = ConnectionGate(max_open=max_connections, idle_s=timeout_s)
            self._receiver = self._call(TcpReceiver.listen(listen[0], listen[1], max_bytes, key, self._nixl,
                                                           gate)).result()
            self.port = self._receiver.port
            self._task = asyncio.run_coroutine_threadsafe(self._receive_all(), self._loop)

    def _call(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    # ------------------------------------------------------------------ prefill side
    def send(self, host: str, port: int, h: Handover) -> concurrent.futures.Future:
        """Send ``h`` to the decode core at ``host:port``; the future's result is the seconds it took."""
        return self._call(self._send(host, port, h))

    async def _send(self, host: str, port: int, h: Handover) -> float:
        t0 = time.perf_counter()
        try:
            sender = await asyncio.wait_for(TcpSender.connect(host, port, self._key, self._nixl), self.timeout_s)
            try:
                await asyncio.wait_for(sender.send(h), max(0.0, self.timeout_s - (time.perf_counter() - t0)))
            finally:
                await sender.close()
        except BaseException as e:
            self.stats["handover_send_failures"] += 1
            if isinstance(e, (asyncio.TimeoutError, TimeoutError)):
                self.stats["handover_send_timeouts"] += 1
                raise TimeoutError(f"the hand-over to {host}:{port} took longer than {self.timeout_s:g} s") from None
            raise
        dt = time.perf_counter() - t0
        self.stats["handover_sent"] += 1
        if sender.mode == NIXL:
            self.stats["handover_sent_nixl"] += 1
        self.stats["handover_sent_bytes"] += h.kv_bytes
        self.stats["handover_send_ms"] += int(dt * 1000)
        return dt

    # ------------------------------------------------------------------ decode side
    async def _receive_all(self) -> None:
        while True:
            try:
                h = await self._receiver.receive()
            except TransferError as e:
                self.stats["handover_auth_failures" if e.auth else "handover_receive_errors"] += 1
                log.warning("a hand-over could not be read: %s", e)
                continue
            with self._lock:
                self._arrived[h.request_id] = (h, time.monotonic())
            self.stats["handover_received"] += 1
            self.stats["handover_received_bytes"] += sum(len(p.data) for p in h.pages)
            del h  # held only in ``_arrived``: NIXL's receive buffer goes back to its pool once it is used

    def take(self, transfer_id: str) -> Handover | None:
        """The hand-over that arrived under ``transfer_id`` (removed), or None (not yet, or never)."""
        with self._lock:
            got = self._arrived.pop(transfer_id, None)
        return None if got is None else got[0]

    def drop(self, transfer_id: str) -> None:
        self.take(transfer_id)

    def expire(self) -> int:
        """Drop hand-overs no request claimed within ``ttl_s``; how many."""
        limit = time.monotonic() - self.ttl_s
        with self._lock:
            old = [k for k, (_, t) in self._arrived.items() if t < limit]
            for k in old:
                del self._arrived[k]
        self.stats["handover_expired"] += len(old)
        return len(old)

    @property
    def num_held(self) -> int:
        with self._lock:
            return len(self._arrived)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._receiver is not None:
            try:
                self._call(self._receiver.close()).result(timeout=5)
            except Exception:  # closing at exit: nothing to keep
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()
