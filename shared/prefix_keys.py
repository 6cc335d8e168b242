"""Prefix fingerprints of a prompt for cache-aware LLM routing.

The prompt is rendered as one stream (role markers, text, media content hashes), cut into
fixed-size blocks, and block ``i`` is keyed by a hash chained over blocks ``0..i``: two prompts
share the first ``k`` keys exactly when they share the first ``k`` blocks."""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from shared.schemas import PromptMedia, PromptMessage

BLOCK_CHARS = 64
MAX_BLOCKS = 512


def render_prefix(messages: Sequence[PromptMessage]) -> str:
    out: list[str] = []
    for m in messages:
        out.append(f"\x00{m.role}\x01")
        for p in m.content:
            if isinstance(p, PromptMedia):
                out.append(f"\x02{p.modality}:{p.content_hash}:{p.num_tokens}\x03")
            else:
                out.append(p.text)
    return "".join(out)


def prefix_blocks(
    messages: Sequence[PromptMessage], block_chars: int = BLOCK_CHARS, max_blocks: int = MAX_BLOCKS
) -> list[int]:
    """Chained 64-bit hashes of the leading blocks of the rendered prompt.

    The trailing partial block gets a key too, so that identical short prompts (shorter than
    one block, e.g. a short question plus one image) still stick to one replica."""
    stream = render_prefix(messages).encode("utf-8", errors="surrogatepass")
    n = min(len(stream) // block_chars, max_blocks)
    keys: list[int] = []
    h = 0
    for i in range(n):
        h = xxhash.xxh3_64_intdigest(stream[i * block_chars : (i + 1) * block_chars], seed=h)
        keys.append(h)
    tail = stream[n * block_chars :]
    if tail and n < max_blocks:
        keys.append(xxhash.xxh3_64_intdigest(tail, seed=h ^ 0x5BD1E995))
    return keys
