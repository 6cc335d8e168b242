"""How a hand-over travels from a prefill replica to a decode replica.

``HandoverSender`` / ``HandoverReceiver`` are the interface: ``send(handover)`` and ``receive()``.
A transfer library (NIXL, Mooncake's transfer engine) drops in behind it as another pair in
``TRANSPORTS``; what ships here is ``tcp``, a plain asyncio stream (docs/disagg.md says what was
checked of the others).

The ``tcp`` wire, one hand-over after another on a connection: an 8-byte big-endian length and the
msgpack of the ``Handover`` with its pages' bytes left out (the head: ids, first token, the page
list with lengths and digests), then every page's bytes in order. A connection that ends inside a
head is an error; one that ends inside the pages still yields the hand-over, its cut page short
and the pages after it empty, for the decode side to detect (``decode.check``) and recompute.
"""

from __future__ import annotations

import asyncio
import struct
from abc import ABC, abstractmethod

import msgspec

from llm_svc.disagg.messages import Handover

_LEN = struct.Struct(">Q")
MAX_HEAD_BYTES = 64 * 1024 * 1024


class TransferError(Exception):
    """A hand-over could not be read (a cut or malformed head)."""


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


async def read_handover(reader: asyncio.StreamReader) -> Handover | None:
    """The next hand-over on ``reader``; None when the stream ended cleanly before one."""
    try:
        raw = await reader.readexactly(_LEN.size)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise TransferError("hand-over cut inside its length") from e
    (size,) = _LEN.unpack(raw)
    if size > MAX_HEAD_BYTES:
        raise TransferError(f"hand-over head of {size} bytes (at most {MAX_HEAD_BYTES})")
    try:
        head = msgspec.msgpack.decode(await reader.readexactly(size), type=Handover)
    except (asyncio.IncompleteReadError, msgspec.DecodeError, msgspec.ValidationError) as e:
        raise TransferError(f"hand-over head unreadable: {type(e).__name__}") from e
    pages, cut = [], False
    for p in head.pages:
        data = b""
        if not cut:
            try:
                data = await reader.readexactly(p.nbytes)
            except asyncio.IncompleteReadError as e:
                data, cut = e.partial, True
        pages.append(msgspec.structs.replace(p, data=data))
    return msgspec.structs.replace(head, pages=pages)


class TcpSender(HandoverSender):
    """One connection to a ``TcpReceiver``."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self.bytes_sent = 0

    @classmethod
    async def connect(cls, host: str, port: int) -> "TcpSender":
        _, writer = await asyncio.open_connection(host, port)
        return cls(writer)

    async def send(self, h: Handover) -> None:
        for f in frames(h):
            self._writer.write(f)
            self.bytes_sent += len(f)
        await self._writer.drain()

    async def close(self) -> None:
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except ConnectionError:
            pass


class TcpReceiver(HandoverReceiver):
    """Listens on ``host:port`` (0: any free port, then ``port`` says which); hand-overs from
    every connection arrive in one queue."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Handover | TransferError] = asyncio.Queue()
        self._server: asyncio.AbstractServer | None = None
        self.port = 0

    @classmethod
    async def listen(cls, host: str = "127.0.0.1", port: int = 0) -> "TcpReceiver":
        r = cls()
        r._server = await asyncio.start_server(r._serve, host, port)
        r.port = r._server.sockets[0].getsockname()[1]
        return r

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    h = await read_handover(reader)
                except TransferError as e:
                    await self._queue.put(e)
                    break
                if h is None:
                    break
                await self._queue.put(h)
        finally:
            writer.close()

    async def receive(self) -> Handover:
        got = await self._queue.get()
        if isinstance(got, TransferError):
            raise got
        return got

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


TRANSPORTS = {"tcp": (TcpSender, TcpReceiver)}
