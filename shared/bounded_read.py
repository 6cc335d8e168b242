"""Reading a body of bytes with a limit: refused from its declared length when that is already too
long, else as soon as the bytes read pass the limit; never buffered past it."""

from __future__ import annotations

from collections.abc import AsyncIterator


class TooLarge(Exception):
    """More than ``limit`` bytes: ``declared`` is the Content-Length that said so, or None when the
    bytes read passed the limit."""

    def __init__(self, limit: int, declared: int | None = None):
        super().__init__(f"{declared if declared is not None else 'more than ' + str(limit)} bytes; "
                         f"the limit is {limit}")
        self.limit, self.declared = limit, declared


async def read_bounded(chunks: AsyncIterator[bytes], limit: int, declared: str | None = None) -> bytes:
    """The bytes of ``chunks``, at most ``limit`` of them, else ``TooLarge``. ``declared`` is the
    sender's Content-Length header, if any."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLarge(limit, int(declared))
    parts, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise TooLarge(limit)
        parts.append(chunk)
    return b"".join(parts)
