"""How a hand-over travels from a prefill replica to a decode replica.

``HandoverSender`` / ``HandoverReceiver`` are the interface: ``send(handover)`` and ``receive()``.
A transfer library (NIXL, Mooncake's transfer engine) drops in behind it as another pair in
``TRANSPORTS``; what ships here is ``tcp``, a plain asyncio stream (docs/disagg.md says what was
checked of the others).

The ``tcp`` wire opens with a challenge: the receiver sends 16 random bytes, the sender answers
with their HMAC-SHA256 under the services' shared token (``service_token``; no token: an empty
key, for one machine), and a receiver that gets another answer reads nothing more from that peer.
Then one hand-over after another on the connection: an 8-byte big-endian length and the
msgpack of the ``Handover`` with its pages' bytes left out (the head: ids, first token, the page
list with lengths and digests), then every page's bytes in order. A connection that ends inside a
head is an error; one that ends inside the pages still yields the hand-over, its cut page short
and the pages after it empty, for the decode side to detect (``decode.check``) and recompute.

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
from abc import ABC, abstractmethod

import msgspec

from llm_svc.disagg.messages import Handover, KVPage

_LEN = struct.Struct(">Q")
MAX_HEAD_BYTES = 64 * 1024 * 1024
# a hand-over's pages in all: a 128K-token MiMo-V2.5-Pro prompt moves 6.3 GiB (bf16)
MAX_HANDOVER_BYTES = 16 * 1024**3


NONCE_BYTES = 16
_AUTH = b"mmserve-handover\0"


def auth_tag(key: bytes, nonce: bytes) -> bytes:
    """The sender's answer to the receiver's ``nonce`` (32 bytes)."""
    return hmac.new(key, _AUTH + nonce, hashlib.sha256).digest()


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
    """``h`` as the ``tcp`` wire's byte strings (length + head, then each page's bytes)."""
    head = msgspec.msgpack.encode(msgspec.structs.replace(
        h, pages=[msgspec.structs.replace(p, data=b"") for p in h.pages]))
    return [_LEN.pack(len(head)) + head, *(p.data for p in h.pages)]


class TcpSender(HandoverSender):
    """One connection to a ``TcpReceiver``; pages go out with ``sock_sendall`` from their own
    bytes (no copy into a transport buffer)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.bytes_sent = 0

    @classmethod
    async def connect(cls, host: str, port: int, key: bytes = b"") -> "TcpSender":
        """Connect and answer the receiver's challenge with ``key`` (the shared token)."""
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, (host, port))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = b""
            while len(nonce) < NONCE_BYTES:
                got = await loop.sock_recv(sock, NONCE_BYTES - len(nonce))
                if not got:
                    raise ConnectionError(f"{host}:{port} closed before its hand-over challenge")
                nonce += got
            await loop.sock_sendall(sock, auth_tag(key, nonce))
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    async def send(self, h: Handover) -> None:
        loop = asyncio.get_running_loop()
        for f in frames(h):
            await loop.sock_sendall(self._sock, f)
            self.bytes_sent += len(f)

    async def close(self) -> None:
        self._sock.close()


class HandoverProtocol(asyncio.BufferedProtocol):
    """Reads the ``tcp`` wire straight into each part's own buffer (no stream buffer in between:
    asyncio's ``StreamReader`` moved a 238 MiB hand-over at a fifth of the socket's rate here).
    Every hand-over, or ``TransferError``, goes to ``out``. Parts: ``auth`` (the peer's 32-byte
    answer to the challenge, once), then per hand-over ``len`` (8 bytes), ``head``, then ``page``
    after page."""

    def __init__(self, out: asyncio.Queue, max_bytes: int = MAX_HANDOVER_BYTES, key: bytes = b"") -> None:
        self.out = out
        self.max_bytes = max_bytes
        self.transport: asyncio.BaseTransport | None = None
        self._key = key
        self._nonce = os.urandom(NONCE_BYTES)
        self._part("auth", 32)

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
        self._got += nbytes
        while self._phase != "failed" and self._got == len(self._buf) and self._advance():
            pass

    def _advance(self) -> bool:
        """The current part is complete: start the next; False when it waits for bytes."""
        if self._phase == "auth":
            if not hmac.compare_digest(bytes(self._buf), auth_tag(self._key, self._nonce)):
                return self._fail("a hand-over peer did not answer the challenge with the shared token "
                                  "(MMSERVE_LLM_SERVICE_TOKEN differs, or not a replica)", auth=True)
            self._next_handover()
            return True
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
        else:
            self._pages.append(msgspec.structs.replace(self._head.pages[len(self._pages)], data=bytes(self._buf)))
        if len(self._pages) == len(self._head.pages):
            self.out.put_nowait(msgspec.structs.replace(self._head, pages=self._pages))
            self._next_handover()
            return False
        self._part("page", self._head.pages[len(self._pages)].nbytes)
        return True

    def _fail(self, why: str, auth: bool = False) -> bool:
        self.out.put_nowait(TransferError(why, auth=auth))
        self._part("failed", 1 << 16)  # what still arrives is read and dropped
        self.transport.close()
        return False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        transport.write(self._nonce)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._phase == "page":  # cut inside the pages: the cut page short, the rest empty
            pages = [*self._pages, msgspec.structs.replace(self._head.pages[len(self._pages)],
                                                           data=bytes(self._buf[:self._got]))]
            pages += [msgspec.structs.replace(p, data=b"") for p in self._head.pages[len(pages):]]
            self.out.put_nowait(msgspec.structs.replace(self._head, pages=pages))
        elif self._phase == "head" or (self._phase == "len" and self._got):
            self.out.put_nowait(TransferError("hand-over cut inside its head"))


class TcpReceiver(HandoverReceiver):
    """Listens on ``host:port`` (0: any free port, then ``port`` says which); hand-overs from
    every connection arrive in one queue."""

    def __init__(self, max_bytes: int = MAX_HANDOVER_BYTES) -> None:
        self._queue: asyncio.Queue[Handover | TransferError] = asyncio.Queue()
        self._server: asyncio.AbstractServer | None = None
        self.max_bytes = max_bytes
        self.port = 0

    @classmethod
    async def listen(cls, host: str = "127.0.0.1", port: int = 0,
                     max_bytes: int = MAX_HANDOVER_BYTES, key: bytes = b"") -> "TcpReceiver":
        """``max_bytes``: the most page bytes one hand-over may announce (its head is refused
        past it, before anything is allocated); ``key``: the token a sender must prove it holds."""
        r = cls(max_bytes)
        loop = asyncio.get_running_loop()
        r._server = await loop.create_server(lambda: HandoverProtocol(r._queue, max_bytes, key), host, port)
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


TRANSPORTS = {"tcp": (TcpSender, TcpReceiver)}
