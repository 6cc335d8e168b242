"""Content-Encoding of a fetched body, undone under a byte cap as the body streams in.

httpx decodes each network chunk whole before anyone can count it: a 64 KiB chunk of a gzip
bomb is 64 MiB in memory before the size check sees it. Here every decompression step asks
zlib for at most the bytes left under the cap (``max_length``), so a body that inflates past
the cap is refused after producing ``limit + 1`` bytes, never all of them.
"""

from __future__ import annotations

import zlib

# What we ask servers for (httpx would also offer br / zstd when their packages are installed,
# and those decoders cannot be bounded the same way).
ACCEPT_ENCODING = "gzip, deflate"


class DecodedTooLarge(Exception):
    """The decoded body passed the cap."""


class UnsupportedEncoding(Exception):
    """A Content-Encoding we do not decode (the message names it)."""


class _Identity:
    def feed(self, data: bytes, limit: int) -> bytes:
        if len(data) > limit:
            raise DecodedTooLarge()
        return data


class _Zlib:
    """gzip (multi-member too) or deflate (zlib-wrapped, or raw as some servers send it)."""

    def __init__(self, encoding: str) -> None:
        self._gzip = encoding in ("gzip", "x-gzip")
        self._raw_fallback = not self._gzip
        self._d = zlib.decompressobj(16 + zlib.MAX_WBITS if self._gzip else zlib.MAX_WBITS)
        self._started = False

    def feed(self, data: bytes, limit: int) -> bytes:
        """Decoded bytes of ``data``; raises ``DecodedTooLarge`` once they pass ``limit``, having
        produced at most ``limit + 1`` of them."""
        out = bytearray()
        while data:
            try:
                got = self._d.decompress(data, limit + 1 - len(out))
            except zlib.error:
                if self._raw_fallback and not self._started:  # deflate sent without the zlib header
                    self._raw_fallback = False
                    self._d = zlib.decompressobj(-zlib.MAX_WBITS)
                    continue
                raise
            self._started = True
            out += got
            if len(out) > limit:
                raise DecodedTooLarge()
            if self._d.eof:  # a gzip member ended; another may follow
                data = self._d.unused_data
                if data and self._gzip:
                    self._d = zlib.decompressobj(16 + zlib.MAX_WBITS)
                    continue
                break
            data = self._d.unconsumed_tail
        return bytes(out)


def _decoder(encoding: str):
    if encoding in ("", "identity"):
        return _Identity()
    if encoding in ("gzip", "x-gzip", "deflate"):
        return _Zlib(encoding)
    raise UnsupportedEncoding(f"the server sent Content-Encoding {encoding!r}; only gzip and deflate are decoded")


class BoundedDecoder:
    """Undoes a Content-Encoding chain (``gzip``, ``deflate``, ``identity``, comma-separated as the
    header lists them, applied last-first) and counts the decoded bytes against ``limit``."""

    def __init__(self, content_encoding: str, limit: int) -> None:
        names = [e.strip().lower() for e in content_encoding.split(",") if e.strip()]
        self._chain = [_decoder(e) for e in reversed(names)] or [_Identity()]
        self.encodings = [e for e in names if e != "identity"]
        self.limit = limit
        self.size = 0

    def feed(self, raw: bytes) -> bytes:
        """The decoded bytes of the next raw chunk; raises ``DecodedTooLarge`` past ``limit``
        (an inner layer of a chain is held to the same cap), ``zlib.error`` on corrupt data."""
        data = raw
        for d in self._chain[:-1]:
            data = d.feed(data, self.limit)
        data = self._chain[-1].feed(data, self.limit - self.size)
        self.size += len(data)
        return data
