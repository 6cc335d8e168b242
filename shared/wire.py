"""Binary wire format: tensors as safetensors bytes, with a typed pydantic header in metadata.

A message is ``safetensors(tensors, metadata={"header": <model JSON>, "header_type": <name>})``.
It carries embeddings without JSON floats and without pickle.
"""

from __future__ import annotations

import json
from typing import TypeVar

import torch
from pydantic import BaseModel
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

SAFETENSORS_MIME = "application/x-safetensors"
M = TypeVar("M", bound=BaseModel)


class WireError(ValueError):
    """The bytes are not a valid mmserve message."""


def pack(tensors: dict[str, torch.Tensor], header: BaseModel) -> bytes:
    """Serialize tensors plus a typed header into one safetensors blob."""
    flat = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    meta = {"header": header.model_dump_json(), "header_type": type(header).__name__}
    return st_save(flat, metadata=meta)


def unpack(data: bytes, header_type: type[M]) -> tuple[dict[str, torch.Tensor], M]:
    """Inverse of ``pack``; raises ``WireError`` on malformed bytes or a header of another type."""
    if len(data) < 8:
        raise WireError("message too short to be safetensors")
    try:
        n = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8 : 8 + n]).get("__metadata__") or {}
        tensors = st_load(bytes(data))
    except Exception as e:  # safetensors raises several types
        raise WireError(f"not a safetensors message: {e}") from e
    if meta.get("header_type") != header_type.__name__:
        raise WireError(f"expected header {header_type.__name__}, got {meta.get('header_type')}")
    try:
        header = header_type.model_validate_json(meta["header"])
    except Exception as e:
        raise WireError(f"invalid {header_type.__name__}: {e}") from e
    return tensors, header
