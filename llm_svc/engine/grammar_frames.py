"""The compile pool's pipe protocol: msgpack objects, each behind its 4-byte big-endian length. Its own
module so that the pool and the worker share it without the worker's grammar imports."""

from __future__ import annotations

import struct
from typing import BinaryIO

import msgspec

_LEN = struct.Struct(">I")


def write_frame(out: BinaryIO, obj) -> None:
    body = msgspec.msgpack.encode(obj)
    out.write(_LEN.pack(len(body)) + body)
    out.flush()


def read_frame(inp: BinaryIO):
    """The next frame's object, or None at end of input (a frame cut short counts as the end)."""
    head = inp.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    n = _LEN.unpack(head)[0]
    body = inp.read(n)
    return msgspec.msgpack.decode(body) if len(body) == n else None
