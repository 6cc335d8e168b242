"""How a hand-over travels from a prefill replica to a decode replica.

``HandoverSender`` / ``HandoverReceiver`` are the interface: ``send(handover)`` and ``receive()``.
One TCP connection carries the control; the pages' bytes go one of two ways, the *mode*: ``T``,
on that stream, or ``N``, by NVIDIA NIXL (``nixl_agent``): a one-sided WRITE into a buffer the
receiver registered for the hand-over (docs/disagg.md: ~5x the stream's rate here).

The wire opens with a challenge: the receiver sends 16 random bytes and the modes it takes
(``T``, or ``N`` when it has NIXL: it takes ``T`` too); the sender answers with their
HMAC-SHA256 under the services' shared token (``service_token``; no token: an empty key, for one
machine) and the mode it picked (``N`` only when offered and it has NIXL), and a receiver that
gets another answer reads nothing more from that peer. Then one hand-over after another on the
connection: an 8-byte big-endian length and the msgpack of the ``Handover`` with its pages' bytes
left out (the head: ids, first token, the page list with lengths and digests), then
* mode ``T``: every page's bytes in order;
* mode ``N``: the receiver registers a buffer for the pages and answers (length, msgpack) with
  its NIXL agent's metadata, taken after that registration (the whole metadata: loading it
  replaces the sender's view of the agent, where a partial one would pile up), and the buffer's
  descriptors; the sender WRITEs the pages there, tagged with the request id, and sends one
  byte, ``D`` (done) or ``E`` (its WRITE failed); the receiver takes the pages once NIXL's
  notification for that tag has come (the buffer comes from a pool of registered ones, back in
  it once the hand-over is used).
A connection that ends inside a head is an error; one that ends inside the pages (or before
``D``, or after ``E``) still yields the hand-over, its cut page short and the pages after it empty
(mode ``N``: every page empty), for the decode side to detect (``decode.check``) and recompute.

Measured (``docs/disagg.md``): a 4,096-token MiMo-V2.5-Pro hand-over (238 MiB) between two
processes on loopback, 2-core VM under load: 0.45-0.47 GiB/s (asyncio streams on both ends:
0.27-0.36; a bare ``recv_into`` loop: 0.4-1.9).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import socket
import struct
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import msgspec

from llm_svc.disagg.messages import Handover, KVPage
from llm_svc.disagg.nixl_agent import NixlEndpoint, RecvBuffer

_LEN = struct.Struct(">Q")
MAX_HEAD_BYTES = 64 * 1024 * 1024
# a hand-over's pages in all: a 128K-token MiMo-V2.5-Pro prompt moves 6.3 GiB (bf16)
MAX_HANDOVER_BYTES = 16 * 1024**3


NONCE_BYTES = 16
_AUTH = b"mmserve-handover\0"
STREAM, NIXL = b"T", b"N"  # how the pages travel (the module doc)
# mode N on the receiver: how often it polls NIXL while a WRITE is under way, how long it waits
# for the notification once the sender said its WRITE is done, and for a whole WRITE
POLL_S = 0.0005
NOTIF_WAIT_S = 10.0
LAND_LIMIT_S = 600.0


GREETING_BYTES = NONCE_BYTES + 1  # the challenge and the modes offered


def auth_tag(key: bytes, nonce: bytes) -> bytes:
    """The sender's answer to the receiver's ``nonce`` (32 bytes)."""
    return hmac.new(key, _AUTH + nonce, hashlib.sha256).digest()


def answer(key: bytes, greeting: bytes, mode: bytes = b"T") -> bytes:
    """What a sender holding ``key`` sends back to the receiver's ``greeting``, asking for ``mode``."""
    return auth_tag(key, greeting[:NONCE_BYTES]) + mode


class TransferError(Exception):
    """A hand-over could not be read (a cut or malformed head), or its peer failed the challenge
    (``auth``)."""

    def __init__(self, why: str, auth: bool = False) -> None:
        super().__init__(why)
        self.auth = auth


class HandoverSender(ABC):
    @abstractmethod
    async def send(self, h: Handover) -> None:
        """Deliver ``h`` (all its pages) or raise; returns once the bytes are handed to the link."""

    @abstractmethod
    async def close(self) -> None: ...


class HandoverReceiver(ABC):
    @abstractmethod
    async def receive(self) -> Handover:
        """The next hand-over; a cut transfer comes back with short pages (never a wrong one).
        Raises ``TransferError`` when not even its head arrived."""

    @abstractmethod
    async def close(self) -> None: ...


def frames(h: Handover) -> list[bytes]:
    """``h`` as the mode-``T`` wire's byte strings (length + head, then each page's bytes)."""
    return [head_frame(h), *(p.data for p in h.pages)]


def head_frame(h: Handover) -> bytes:
    """Length + the msgpack of ``h`` without its pages' bytes."""
    head = msgspec.msgpack.encode(msgspec.structs.replace(
        h, pages=[msgspec.structs.replace(p, data=b"") for p in h.pages]))
    return _LEN.pack(len(head)) + head


async def _recv_exact(loop, sock: socket.socket, n: int, what: str) -> bytes:
    got = bytearray()
    while len(got) < n:
        part = await loop.sock_recv(sock, n - len(got))
        if not part:
            raise ConnectionError(f"the decode replica closed the connection before its {what}")
        got += part
    return bytes(got)


async def _recv_frame(loop, sock: socket.socket, what: str, limit: int = MAX_HEAD_BYTES) -> bytes:
    (n,) = _LEN.unpack(await _recv_exact(loop, sock, _LEN.size, what))
    if n > limit:
        raise ConnectionError(f"the decode replica's {what} announced {n} bytes (at most {limit})")
    return await _recv_exact(loop, sock, n, what)


class TcpSender(HandoverSender):
    """One connection to a ``TcpReceiver``. Mode ``T``: pages go out with ``sock_sendall`` from
    their own bytes (no copy into a transport buffer); mode ``N``: by ``nixl``'s WRITE."""

    def __init__(self, sock: socket.socket, nixl: NixlEndpoint | None = None) -> None:
        self._sock = sock
        self._nixl = nixl
        self.bytes_sent = 0

    @property
    def mode(self) -> bytes:
        return NIXL if self._nixl is not None else STREAM

    @classmethod
    async def connect(cls, host: str, port: int, key: bytes = b"", nixl: NixlEndpoint | None = None) -> "TcpSender":
        """Connect and answer the receiver's challenge with ``key`` (the shared token); the pages
        go by ``nixl`` when given and the receiver offers it."""
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, (host, port))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            greeting = await _recv_exact(loop, sock, GREETING_BYTES, "hand-over challenge")
            use = nixl if greeting[NONCE_BYTES:] == NIXL else None
            await loop.sock_sendall(sock, answer(key, greeting, NIXL if use else STREAM))
        except BaseException:
            sock.close()
            raise
        return cls(sock, use)

    async def send(self, h: Handover) -> None:
        loop = asyncio.get_running_loop()
        if self._nixl is None:
            for f in frames(h):
                await loop.sock_sendall(self._sock, f)
                self.bytes_sent += len(f)
            return
        f = head_frame(h)
        await loop.sock_sendall(self._sock, f)
        try:
            metadata, descs = msgspec.msgpack.decode(await _recv_frame(loop, self._sock, "NIXL descriptors"),
                                                     type=tuple[bytes, bytes])
        except msgspec.DecodeError as e:
            raise ConnectionError(f"the decode replica's NIXL descriptors are unreadable: {e}") from None
        try:
            await self._nixl.write(self._nixl.peer(metadata), [p.data for p in h.pages], descs,
                                   h.request_id.encode())
        except Exception:
            await loop.sock_sendall(self._sock, b"E")
            raise
        await loop.sock_sendall(self._sock, b"D")
        self.bytes_sent += len(f) + h.kv_bytes

    async def close(self) -> None:
        self._sock.close()


class HandoverProtocol(asyncio.BufferedProtocol):
    """Reads the ``tcp`` wire straight into each part's own buffer (no stream buffer in between:
    asyncio's ``StreamReader`` moved a 238 MiB hand-over at a fifth of the socket's rate here).
    Every hand-over, or ``TransferError``, goes to ``out``. Parts: ``auth`` (the peer's 32-byte
    answer to the challenge and its mode, once), then per hand-over ``len`` (8 bytes), ``head``,
    then ``page`` after page (mode ``T``) or the sender's ``done`` byte (mode ``N``, with
    ``nixl``: the pages land in a registered buffer)."""

    def __init__(self, out: asyncio.Queue, max_bytes: int = MAX_HANDOVER_BYTES, key: bytes = b"",
                 nixl: NixlEndpoint | None = None, gate: "ConnectionGate | None" = None) -> None:
        self.out = out
        self.max_bytes = max_bytes
        self._gate = gate or ConnectionGate()
        self._admitted = False
        self._idle: asyncio.TimerHandle | None = None
        self._last = 0.0
        self.transport: asyncio.BaseTransport | None = None
        self._key = key
        self._nixl = nixl
        self._mode = STREAM
        self._ended: dict[str, str] = {}  # mode N: how the hand-over in flight's WRITE ended
        self._tasks: set[asyncio.Task] = set()  # mode N: hand-overs waiting for their notification
        self._nonce = os.urandom(NONCE_BYTES)
        self._part("auth", 33)

    def _next_handover(self) -> None:
        self._head: Handover | None = None
        self._pages: list[KVPage] = []
        self._part("len", _LEN.size)

    def _part(self, phase: str, n: int) -> None:
        self._phase = phase
        self._buf = bytearray(n)
        self._got = 0

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self._buf)[self._got:]

    def buffer_updated(self, nbytes: int) -> None:
        self._last = time.monotonic()
        self._got += nbytes
        while self._phase != "failed" and self._got == len(self._buf) and self._advance():
            pass

    def _advance(self) -> bool:
        """The current part is complete: start the next; False when it waits for bytes."""
        if self._phase == "auth":
            if not hmac.compare_digest(bytes(self._buf[:32]), auth_tag(self._key, self._nonce)):
                return self._fail("a hand-over peer did not answer the challenge with the shared token "
                                  "(MMSERVE_LLM_SERVICE_TOKEN differs, or not a replica)", auth=True)
            self._mode = bytes(self._buf[32:])
            if self._mode not in (STREAM, NIXL) or (self._mode == NIXL and self._nixl is None):
                return self._fail(f"a hand-over peer asked for mode {self._mode!r}, which this replica does not take")
            self._next_handover()
            return True
        if self._phase == "done":
            self._ended["state"] = "D" if bytes(self._buf) == b"D" else "E"
            self._next_handover()
            return False
        if self._phase == "len":
            (size,) = _LEN.unpack(self._buf)
            if size > MAX_HEAD_BYTES:
                return self._fail(f"hand-over head of {size} bytes (at most {MAX_HEAD_BYTES})")
            self._part("head", size)
            return True
        if self._phase == "head":
            try:
                self._head = msgspec.msgpack.decode(self._buf, type=Handover)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                return self._fail(f"hand-over head unreadable: {type(e).__name__}")
            total = sum(p.nbytes for p in self._head.pages)
            if total > self.max_bytes or any(p.nbytes < 0 for p in self._head.pages):
                return self._fail(f"hand-over of {total} bytes (at most {self.max_bytes})")
            if self._mode == NIXL:
                rb = self._nixl.open_buffer([p.nbytes for p in self._head.pages])
                reply = msgspec.msgpack.encode((self._nixl.metadata(), rb.descs))
                self.transport.write(_LEN.pack(len(reply)) + reply)
                self._nixl_land(rb)
                self._part("done", 1)
                return True
        else:
            self._pages.append(msgspec.structs.replace(self._head.pages[len(self._pages)], data=bytes(self._buf)))
        if len(self._pages) == len(self._head.pages):
            self.out.put_nowait(msgspec.structs.replace(self._head, pages=self._pages))
            self._next_handover()
            return False
        self._part("page", self._head.pages[len(self._pages)].nbytes)
        return True

    def _nixl_land(self, rb: RecvBuffer) -> None:
        """Mode ``N``, the descriptors of ``rb`` sent: poll NIXL (its progress: no progress thread runs)
        until the WRITE's notification comes (the pages are in the buffer), the sender says its
        WRITE failed or the connection ends (every page empty), or ``NOTIF_WAIT_S`` after the
        sender said done, or ``LAND_LIMIT_S`` in all; then the hand-over goes out."""
        head = self._head
        ended = self._ended = {}  # "state": D (the sender's WRITE is done), E (it failed), cut

        async def land() -> None:
            notif = head.request_id.encode()
            start, done_at, landed = time.monotonic(), None, False
            while not landed:
                landed = self._nixl.arrived(notif)
                state, now = ended.get("state"), time.monotonic()
                if landed or state in ("E", "cut") or now - start > LAND_LIMIT_S:
                    break
                if state == "D":
                    done_at = done_at or now
                    if now - done_at > NOTIF_WAIT_S:
                        break
                await asyncio.sleep(POLL_S)
            if not landed:
                self._nixl.discard(rb)
            # the pages are views of the buffer: the pool has it back once the hand-over is dropped
            pages = [msgspec.structs.replace(p, data=rb.page(i) if landed else b"") for i, p in enumerate(head.pages)]
            self.out.put_nowait(msgspec.structs.replace(head, pages=pages))

        task = asyncio.get_running_loop().create_task(land())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _fail(self, why: str, auth: bool = False) -> bool:
        self.out.put_nowait(TransferError(why, auth=auth))
        self._part("failed", 1 << 16)  # what still arrives is read and dropped
        self.transport.close()
        return False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        gate = self._gate
        if gate.open >= gate.max_open:
            self._fail(f"more than {gate.max_open} hand-over connections at once: one refused")
            return
        gate.open += 1
        self._admitted = True
        self._last = time.monotonic()
        try:
            self._idle = asyncio.get_running_loop().call_later(gate.idle_s, self._check_idle)
        except RuntimeError:  # driven by hand, outside a loop (the wire's unit tests): no timer
            pass
        transport.write(self._nonce + (NIXL if self._nixl is not None else STREAM))

    def _check_idle(self) -> None:
        """A peer that sends nothing for ``idle_s`` is cut (what it left is dealt with as any cut
        connection): a connection, its buffers and its slot in the gate are not held for ever."""
        quiet = time.monotonic() - self._last
        if quiet < self._gate.idle_s:
            self._idle = asyncio.get_running_loop().call_later(self._gate.idle_s - quiet, self._check_idle)
            return
        self._idle = None
        if self._phase == "auth":
            self.out.put_nowait(TransferError(f"a hand-over peer did not answer the challenge within "
                                              f"{self._gate.idle_s:g} s"))
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._admitted:
            self._gate.open -= 1
            self._admitted = False
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        if self._phase == "done":  # mode N, cut before the sender said its WRITE ended
            self._ended["state"] = "cut"
        elif self._phase == "page":  # cut inside the pages: the cut page short, the rest empty
            pages = [*self._pages, msgspec.structs.replace(self._head.pages[len(self._pages)],
                                                           data=bytes(self._buf[:self._got]))]
            pages += [msgspec.structs.replace(p, data=b"") for p in self._head.pages[len(pages):]]
            self.out.put_nowait(msgspec.structs.replace(self._head, pages=pages))
        elif self._phase == "head" or (self._phase == "len" and self._got):
            self.out.put_nowait(TransferError("hand-over cut inside its head"))


@dataclass
class ConnectionGate:
    """A receiver's limits on its connections: at most ``max_open`` at once (more are refused as
    they come), each cut once it sends nothing for ``idle_s``."""

    max_open: int = 64
    idle_s: float = 30.0
    open: int = 0


class TcpReceiver(HandoverReceiver):
    """Listens on ``host:port`` (0: any free port, then ``port`` says which); hand-overs from
    every connection arrive in one queue."""

    def __init__(self, max_bytes: int = MAX_HANDOVER_BYTES) -> None:
        self._queue: asyncio.Queue[Handover | TransferError] = asyncio.Queue()
        self._server: asyncio.AbstractServer | None = None
        self.max_bytes = max_bytes
        self.gate = ConnectionGate()
        self.port = 0

    @classmethod
    async def listen(cls, host: str = "127.0.0.1", port: int = 0, max_bytes: int = MAX_HANDOVER_BYTES,
                     key: bytes = b"", nixl: NixlEndpoint | None = None,
                     gate: ConnectionGate | None = None) -> "TcpReceiver":
        """``max_bytes``: the most page bytes one hand-over may announce (its head is refused
        past it, before anything is allocated); ``key``: the token a sender must prove it holds;
        ``nixl``: offer mode ``N`` (senders without NIXL still use ``T``); ``gate``: the limits on
        connections (default ``ConnectionGate()``)."""
        r = cls(max_bytes)
        r.gate = gate or ConnectionGate()
        loop = asyncio.get_running_loop()
        r._server = await loop.create_server(lambda: HandoverProtocol(r._queue, max_bytes, key, nixl, r.gate),
                                             host, port)
        r.port = r._server.sockets[0].getsockname()[1]
        return r

    async def receive(self) -> Handover:
        got = await self._queue.get()
        if isinstance(got, TransferError):
            raise got
        return got

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


def handover_address(host: str) -> tuple[str, str]:
    """``(bind, advertised)`` for the ``handover_host`` setting: ``auto`` binds every interface
    and advertises this host's own address (one container of a scaled service, a pod: its name
    resolves to it); anything else is both."""
    if host != "auto":
        return host, host
    try:
        return "0.0.0.0", socket.gethostbyname(socket.gethostname())
    except OSError:
        return "0.0.0.0", "127.0.0.1"
