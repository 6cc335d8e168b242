"""``shared.wire``'s format without torch: safetensors bytes read and written as raw buffers.

The gateway forwards embeddings it never computes with (the by-value fallback of media by
reference), so it handles them as ``RawTensor`` (dtype name, shape, bytes) and never imports
torch. A blob written here is read by ``shared.wire.unpack`` and vice versa: the same
safetensors layout (8-byte little-endian header length, JSON header with ``__metadata__``
holding ``header`` / ``header_type``, then the tensor bytes back to back).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from math import prod
from typing import TypeVar

from pydantic import BaseModel

SAFETENSORS_MIME = "application/x-safetensors"
M = TypeVar("M", bound=BaseModel)

# safetensors dtype code -> bytes per element
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header


class RawWireError(ValueError):
    """The bytes are not a valid mmserve message."""


@dataclass(frozen=True)
class RawTensor:
    """A tensor as bytes: ``dtype`` is a safetensors code (``"F32"``, ``"BF16"``, ...),
    ``data`` is row-major and holds exactly ``prod(shape) * DTYPE_BYTES[dtype]`` bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise RawWireError(f"unknown safetensors dtype {self.dtype!r}")
        if any(d < 0 for d in self.shape):
            raise RawWireError(f"negative dimension in shape {list(self.shape)}")
        if len(self.data) != prod(self.shape) * DTYPE_BYTES[self.dtype]:
            raise RawWireError(f"{len(self.data)} bytes do not hold a {self.dtype} tensor of shape {list(self.shape)}")

    @property
    def nbytes(self) -> int:
        return len(self.data)


def pack_raw(tensors: dict[str, RawTensor], header: BaseModel) -> bytes:
    """Tensors plus a typed header as one safetensors blob (what ``shared.wire.pack`` writes)."""
    head: dict = {"__metadata__": {"header": header.model_dump_json(), "header_type": type(header).__name__}}
    offset = 0
    for name, t in tensors.items():
        head[name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return b"".join([len(text).to_bytes(8, "little"), text, *(t.data for t in tensors.values())])


def unpack_raw(data: bytes, header_type: type[M]) -> tuple[dict[str, RawTensor], M]:
    """Inverse of ``pack_raw`` (and of ``shared.wire.pack``); raises ``RawWireError``."""
    if len(data) < 8:
        raise RawWireError("message too short to be safetensors")
    n = int.from_bytes(data[:8], "little")
    if n > _MAX_HEADER or 8 + n > len(data):
        raise RawWireError(f"safetensors header of {n} bytes does not fit a {len(data)}-byte message")
    try:
        head = json.loads(data[8 : 8 + n])
    except ValueError as e:
        raise RawWireError(f"not a safetensors message: {e}") from e
    if not isinstance(head, dict):
        raise RawWireError("not a safetensors message: the header is not an object")
    meta = head.pop("__metadata__", None) or {}
    if meta.get("header_type") != header_type.__name__:
        raise RawWireError(f"expected header {header_type.__name__}, got {meta.get('header_type')}")
    try:
        header = header_type.model_validate_json(meta["header"])
    except Exception as e:
        raise RawWireError(f"invalid {header_type.__name__}: {e}") from e
    body = memoryview(data)[8 + n :]
    tensors: dict[str, RawTensor] = {}
    for name, info in head.items():
        try:
            lo, hi = (int(x) for x in info["data_offsets"])
            dtype, shape = str(info["dtype"]), tuple(int(d) for d in info["shape"])
        except (KeyError, TypeError, ValueError) as e:
            raise RawWireError(f"tensor {name!r}: malformed entry {info!r}") from e
        if not 0 <= lo <= hi <= len(body):
            raise RawWireError(f"tensor {name!r}: offsets {lo}..{hi} outside the {len(body)}-byte data")
        tensors[name] = RawTensor(dtype, shape, bytes(body[lo:hi]))
    return tensors, header
