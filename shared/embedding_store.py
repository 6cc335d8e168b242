"""How an encoder cache tier stores one embedding, for every reader of it: the Redis key of an
entry and the value codec. The encoder's tiers write them (``encoder_svc.cache``); the LLM
front reads the Redis tier directly when it fetches media sent by reference.

* key: ``{prefix}e:{<media key>}`` -- the braces are a Redis Cluster hash tag;
* value: safetensors with one tensor ``embeds`` [num_tokens, hidden] and the media key in its
  metadata, so a hash collision or a stale value is detected on read (a miss, never wrong rows).
  In Redis (shared with other machines) the value is sealed: an HMAC-SHA256 tag under the peer
  key over the media key and the bytes comes first (``seal_entry`` / ``open_entry``,
  ``shared.peer_auth``), so a planted or moved entry is a miss too.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from shared.peer_auth import PeerKey

DEFAULT_PREFIX = "mmserve:enc:"
DOMAIN = "embedding"


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


def seal_entry(peer: PeerKey, key: str, data: bytes) -> bytes:
    """What the Redis tier stores for ``to_bytes(key, ...)``: the tag, then the bytes."""
    return peer.seal(DOMAIN, key, data)


def open_entry(peer: PeerKey, key: str, sealed: bytes) -> bytes | None:
    """The bytes of a Redis entry stored under ``key``, or None when its tag does not check out
    (planted, written under another key or another peer key, or torn)."""
    return peer.open(DOMAIN, key, sealed)
