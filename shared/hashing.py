"""Content hashing of media bytes: the one place that names the hash function.

xxHash3-128 is used: non-cryptographic, ~10 GB/s, 128 bits so accidental collisions between
distinct media are negligible. It keys the encoder cache, the consistent-hash ring and the
prefix-cache keys of multimodal placeholder tokens.
"""

from __future__ import annotations

import xxhash

HASH_NAME = "xxh3_128"


def content_hash(data: bytes | bytearray | memoryview) -> str:
    """Hex digest (32 chars) of the media bytes."""
    return xxhash.xxh3_128_hexdigest(data)


def hash_to_int(hex_digest: str) -> int:
    """A 64-bit integer from a digest, used where a numeric key is needed (token keys)."""
    return int(hex_digest[:16], 16)
