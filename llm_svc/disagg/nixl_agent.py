"""NVIDIA NIXL under the hand-over wire: a hand-over's page bytes move by one one-sided WRITE from
the prefill process's memory into a buffer the decode process registered for it (UCX backend,
DRAM; on GPU hosts the same calls move device memory). The TCP connection keeps the challenge,
the head and a done byte (``transport`` says the wire).

``NixlEndpoint`` is this process's one NIXL agent. It is used from one thread only (the hand-over
link's event loop); NIXL's own progress thread moves the bytes.

NIXL comes from PyPI: ``nixl-cu13`` (or ``nixl-cu12``, or the ``nixl`` meta package that picks one;
the ``nixl`` extra of this project installs ``nixl-cu13``, which runs without a GPU).
"""

from __future__ import annotations

import asyncio
import importlib
import os
import threading
import uuid
import weakref
from dataclasses import dataclass

import numpy as np

DRAM = "DRAM"


def load_nixl():
    """NIXL's ``_api`` module (``nixl_agent``, ``nixl_agent_config``), or None when not installed."""
    for name in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api", "nixl_rocm._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def nixl_available() -> bool:
    return load_nixl() is not None


def _addr(b) -> int:
    """The address of a bytes-like object's first byte (the object must outlive its use)."""
    return np.frombuffer(b, dtype=np.uint8).ctypes.data


@dataclass
class RecvBuffer:
    """One hand-over's landing place on the decode side: ``view`` (uint8, every page back to
    back) in a registered buffer of the endpoint's pool, each page's ``(offset, nbytes)``, and the
    descriptors the sender writes to. The pool takes the buffer back once nothing refers to
    ``view`` any more (its pages are memoryviews of it: the hand-over's last user lets go)."""

    view: np.ndarray
    spans: list[tuple[int, int]]
    descs: bytes  # serialized transfer descriptors, one per non-empty page, for the sender
    lease: "_Lease"

    def page(self, i: int) -> memoryview:
        off, n = self.spans[i]
        return memoryview(self.view)[off:off + n]


@dataclass
class _Lease:
    buf: np.ndarray
    reg: object
    back: weakref.finalize | None = None


class _Pool:
    """Registered receive buffers, reused: a fresh 238 MiB buffer per hand-over cost its page
    faults on every transfer (0.1-1.5 s here, against 60-80 ms into a reused one). Buffers come
    back from any thread (``weakref.finalize``); registration and deregistration happen on the
    caller's (the endpoint's) thread. At most ``keep_bytes`` stay registered while free."""

    def __init__(self, agent, keep_bytes: int) -> None:
        self.agent, self.keep_bytes = agent, keep_bytes
        self._free: list[_Lease] = []  # smallest first
        self._back: list[_Lease] = []  # returned since the last take
        self._lock = threading.Lock()
        self.in_use = 0

    def take(self, nbytes: int) -> tuple[np.ndarray, _Lease]:
        with self._lock:
            back, self._back = self._back, []
        self._free = sorted(self._free + back, key=lambda b: b.buf.nbytes)
        self.in_use -= len(back)
        got = next((b for b in self._free if b.buf.nbytes >= nbytes), None)
        if got is not None:
            self._free.remove(got)
        else:
            buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
            # touched here (~30 ms for 238 MiB): its page faults taken in the peer's WRITE cost
            # 0.4-0.7 s over UCX's cross-process copy on this VM
            buf.fill(0)
            got = _Lease(buf, self.agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], DRAM))
        while self._free and self.free_bytes > self.keep_bytes:
            self.agent.deregister_memory(self._free.pop().reg)  # the largest goes first
        self.in_use += 1
        view = got.buf[:nbytes]
        got.back = weakref.finalize(view, self._give_back, got)
        return view, got

    def _give_back(self, got: _Lease) -> None:
        with self._lock:
            self._back.append(got)

    def discard(self, lease: _Lease) -> None:
        """Never reuse ``lease``'s buffer (a WRITE into it may still come: a transfer given up on)."""
        if lease.back is not None and lease.back.detach() is not None:
            self.in_use -= 1
            self.agent.deregister_memory(lease.reg)

    @property
    def free_bytes(self) -> int:
        return sum(b.buf.nbytes for b in self._free)


class NixlEndpoint:
    """This process's NIXL agent (name unique per process start, so a restarted peer is a new one)."""

    def __init__(self, keep_bytes: int = 1 << 30) -> None:
        """``keep_bytes``: receive buffers kept registered for reuse while no hand-over uses them."""
        api = load_nixl()
        if api is None:
            raise RuntimeError("NIXL is not installed: pip install nixl-cu13 (or set kv_transport=tcp)")
        self.name = f"mmserve-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # no progress thread: it spins a core whole (a CPU replica has two); the calls below make
        # progress (the sender polling its transfer, the receiver polling for notifications)
        self.agent = api.nixl_agent(self.name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.pool = _Pool(self.agent, keep_bytes)
        self._notifs: set[bytes] = set()

    def metadata(self) -> bytes:
        """What a peer needs to WRITE into the memory this agent has registered now."""
        return self.agent.get_agent_metadata()

    def peer(self, metadata: bytes) -> str:
        """The name of the agent whose ``metadata`` this is, loaded (a peer's newer metadata
        replaces what this agent knew of it)."""
        name = self.agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else name

    # ------------------------------------------------------------------ decode side
    def open_buffer(self, sizes: list[int]) -> RecvBuffer:
        """A registered buffer for pages of ``sizes`` bytes (zero-size pages take no descriptor)."""
        view, lease = self.pool.take(sum(sizes))
        spans, off = [], 0
        for n in sizes:
            spans.append((off, n))
            off += n
        base = view.ctypes.data
        descs = [(base + o, n, 0) for o, n in spans if n]
        ser = self.agent.get_serialized_descs(self.agent.get_xfer_descs(descs, DRAM)) if descs else b""
        return RecvBuffer(view, spans, ser, lease)

    def discard(self, rb: RecvBuffer) -> None:
        """``rb`` will not be used (its transfer failed or was given up on): deregistered, never reused."""
        self.pool.discard(rb.lease)

    def arrived(self, notif: bytes) -> bool:
        """Whether the WRITE tagged ``notif`` has landed (its notification came; taken once)."""
        for msgs in self.agent.get_new_notifs().values():
            self._notifs.update(msgs)
        if notif in self._notifs:
            self._notifs.discard(notif)
            return True
        return False

    # ------------------------------------------------------------------ prefill side
    async def write(self, peer: str, pages: list[bytes], remote_descs: bytes, notif: bytes) -> None:
        """WRITE ``pages`` (their non-empty ones, in order) to the peer's ``remote_descs`` with
        ``notif``; returns when NIXL reports the transfer done, raises on its error."""
        pages = [p for p in pages if len(p)]
        if not pages:
            return
        local = [(_addr(p), len(p), 0) for p in pages]
        reg = self.agent.register_memory([(a, n, 0, "") for a, n, _ in local], DRAM)
        handle = None
        try:
            remote = self.agent.deserialize_descs(remote_descs)
            handle = self.agent.initialize_xfer("WRITE", self.agent.get_xfer_descs(local, DRAM), remote, peer, notif)
            state = self.agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                await asyncio.sleep(0.0002)
                state = self.agent.check_xfer_state(handle)
            if state == "ERR":
                raise ConnectionError("the NIXL transfer of a hand-over failed")
        finally:
            if handle is not None:
                self.agent.release_xfer_handle(handle)
            self.agent.deregister_memory(reg)
