"""A lean HTTP/1.1 load generator: POSTs of pre-encoded JSON bodies over a pool of keep-alive
connections, reading only the status line, the headers it needs and the body.

Why not httpx: on this 2-core machine the load generator shares the cores with the stack it
measures, and httpx spends ~1-3 ms of CPU per request; at a few hundred requests a second it
takes most of a core from the stack (measured in ``benchmarks.overload``: 0.85 cores at 250
rps). This client needs a fraction of that, so an overload run measures the stack rather than
its client. Plain ``http://`` only; a response is framed by Content-Length or chunked encoding.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit


class LeanClient:
    """``await post(body)`` -> (status, response body); use as ``async with``."""

    def __init__(self, url: str, timeout: float) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"LeanClient speaks plain http only, got {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.timeout = timeout
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._head = (f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\ncontent-type: application/json\r\n"
                      "content-length: ").encode()
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._open: set[asyncio.StreamWriter] = set()

    async def __aenter__(self) -> "LeanClient":
        return self

    async def __aexit__(self, *exc) -> None:
        for w in list(self._open):
            w.close()
        self._open.clear()
        self._idle.clear()

    async def post(self, body: bytes) -> tuple[int, bytes]:
        """Raises ``TimeoutError`` past ``timeout`` and ``OSError`` / ``ConnectionError`` when the
        connection fails (a pooled connection the server closed is retried once on a new one)."""
        async with asyncio.timeout(self.timeout):
            for attempt in range(2):
                reused = bool(self._idle)
                reader, writer = self._idle.pop() if reused else await self._connect()
                try:
                    return await self._exchange(reader, writer, body)
                except (ConnectionError, asyncio.IncompleteReadError):
                    self._drop(writer)
                    if not reused or attempt:
                        raise
                except BaseException:
                    self._drop(writer)
                    raise
        raise AssertionError("unreachable")

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)
        self._open.add(writer)
        return reader, writer

    def _drop(self, writer: asyncio.StreamWriter) -> None:
        self._open.discard(writer)
        writer.close()

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        body: bytes) -> tuple[int, bytes]:
        writer.write(self._head + str(len(body)).encode() + b"\r\n\r\n" + body)
        status_line = await reader.readline()
        if not status_line:
            raise ConnectionError("the server closed the connection without answering")
        status = int(status_line.split(b" ", 2)[1])
        length, chunked, close = None, False, False
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"connection":
                close = b"close" in value.lower()
        if chunked:
            data = bytearray()
            while size := int((await reader.readline()).split(b";")[0], 16):
                data += await reader.readexactly(size + 2)
                del data[-2:]
            await reader.readline()  # the blank line after the last chunk
            content = bytes(data)
        elif length is not None:
            content = await reader.readexactly(length)
        else:  # framed by the connection's end
            content = await reader.read()
            close = True
        if close:
            self._drop(writer)
        else:
            self._idle.append((reader, writer))
        return status, content
