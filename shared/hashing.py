"""Identity of media: the one place that names the hash function and builds the media key.

* ``content_hash``: SHA-256 of the bytes (hex, 64 chars). A cryptographic hash, because the
  caches it keys are shared across tenants: with a fast non-cryptographic hash an attacker can
  craft a collision and be served another tenant's embeddings or KV (vLLM moved its multimodal
  hashes to SHA-256 after GHSA-rm76-4mrf-v9r8). ~1-2 GB/s per core: small next to decoding.
* ``media_key``: the content hash plus everything else that decides the embedding -- the
  encoder model id (a fingerprint of its weights) and the preprocessing signature (size,
  frames, fps, pooling). It keys the encoder cache and the LLM's prefix-cache keys of media
  tokens, so a rolling encoder upgrade or a different sampling never reuses stale KV.
"""

from __future__ import annotations

import hashlib

HASH_NAME = "sha256"


def content_hash(data: bytes | bytearray | memoryview) -> str:
    """Hex SHA-256 (64 chars) of the media bytes."""
    return hashlib.sha256(data).hexdigest()


def media_key(model_id: str, modality: str, signature: str, digest: str) -> str:
    """``model_id:modality:sha256(signature)[:16]:digest`` -- one item as one encoder sees it."""
    return f"{model_id}:{modality}:{hashlib.sha256(signature.encode()).hexdigest()[:16]}:{digest}"


def hash_to_int(hex_digest: str) -> int:
    """A 64-bit integer from a digest, used where a numeric key is needed (token keys)."""
    return int(hex_digest[:16], 16)
