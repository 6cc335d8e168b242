"""How an encoder cache tier stores one embedding, for every reader of it: the Redis key of an
entry and the value codec. The encoder's tiers write them (``encoder_svc.cache``); the LLM
front reads the Redis tier directly when it fetches media sent by reference.

* key: ``{prefix}e:{<media key>}`` -- the braces are a Redis Cluster hash tag;
* value: safetensors with one tensor ``embeds`` [num_tokens, hidden] and the media key in its
  metadata, so a hash collision or a stale value is detected on read (a miss, never wrong rows).
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

DEFAULT_PREFIX = "mmserve:enc:"


def entry_key(prefix: str, key: str) -> str:
    return f"{prefix}e:{{{key}}}"


def to_bytes(key: str, t: torch.Tensor) -> bytes:
    return st_save({"embeds": t.detach().contiguous().cpu()}, metadata={"key": key})


def from_bytes(key: str, data: bytes) -> torch.Tensor | None:
    """The embeddings stored under ``key``, or None for a torn, foreign or other key's value."""
    try:
        n = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8 : 8 + n]).get("__metadata__") or {}
        if meta.get("key") != key:
            return None
        return st_load(bytes(data))["embeds"]
    except Exception:  # a torn or foreign value is a miss, not an error
        return None
