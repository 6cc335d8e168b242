"""Prefix block keys of a chat prompt: what the gateway's cache-aware router indexes and what
each LLM replica publishes as KV events (the same keys on both sides).

The prompt is rendered as one stream (role markers, text, media content hashes), cut into
fixed-size blocks, and block ``i`` is keyed by a hash chained over blocks ``0..i``: two prompts
share the first ``k`` keys exactly when they share the first ``k`` blocks.

An LLM replica maps each key to the prompt token where its block ends (``key_positions``): the
media spans and the system message's end are exact anchors, text between them is interpolated
(rounded up, so a key never claims fewer tokens than its block covers)."""

from __future__ import annotations

import math
from collections.abc import Container, Sequence
from dataclasses import dataclass, field

import xxhash

from shared.schemas import PromptMedia, PromptMessage

BLOCK_CHARS = 64
MAX_BLOCKS = 512
_TAIL_SEED = 0x5BD1E995


@dataclass
class PrefixLayout:
    """The keys of a rendered prompt, where each key's block ends in the stream (bytes), the
    stream's length, the byte span of each media item (in order) and of the leading system
    message (0 if none)."""

    keys: list[int]
    ends: list[int]
    total: int
    media: list[tuple[int, int]] = field(default_factory=list)
    system_end: int = 0

    def __post_init__(self) -> None:
        assert len(self.keys) == len(self.ends)
        assert all(0 < e <= self.total for e in self.ends)


def _render(messages: Sequence[PromptMessage]) -> tuple[bytes, list[tuple[int, int]], int]:
    out: list[bytes] = []
    media: list[tuple[int, int]] = []
    pos = system_end = 0
    for i, m in enumerate(messages):
        pieces = [f"\x00{m.role}\x01"]
        for p in m.content:
            if isinstance(p, PromptMedia):
                pieces.append(f"\x02{p.modality}:{p.content_hash}:{p.num_tokens}\x03")
            else:
                pieces.append(p.text)
        for piece in pieces:
            b = piece.encode("utf-8", errors="surrogatepass")
            if piece.startswith("\x02") and piece.endswith("\x03"):
                media.append((pos, pos + len(b)))
            out.append(b)
            pos += len(b)
        if i == 0 and m.role == "system":
            system_end = pos
    return b"".join(out), media, system_end


def render_prefix(messages: Sequence[PromptMessage]) -> str:
    return _render(messages)[0].decode("utf-8", errors="surrogatepass")


def prefix_layout(
    messages: Sequence[PromptMessage], block_chars: int = BLOCK_CHARS, max_blocks: int = MAX_BLOCKS
) -> PrefixLayout:
    """Chained 64-bit hashes of the leading blocks of the rendered prompt, with their ends.

    The trailing partial block gets a key too, so that identical short prompts (shorter than
    one block, e.g. a short question plus one image) still stick to one replica."""
    stream, media, system_end = _render(messages)
    n = min(len(stream) // block_chars, max_blocks)
    keys: list[int] = []
    h = 0
    for i in range(n):
        h = xxhash.xxh3_64_intdigest(stream[i * block_chars : (i + 1) * block_chars], seed=h)
        keys.append(h)
    ends = [(i + 1) * block_chars for i in range(n)]
    tail = stream[n * block_chars :]
    if tail and n < max_blocks:
        keys.append(xxhash.xxh3_64_intdigest(tail, seed=h ^ _TAIL_SEED))
        ends.append(len(stream))
    return PrefixLayout(keys, ends, len(stream), media, system_end)


def prefix_blocks(
    messages: Sequence[PromptMessage], block_chars: int = BLOCK_CHARS, max_blocks: int = MAX_BLOCKS
) -> list[int]:
    """The router keys of ``messages`` (``prefix_layout(...).keys``)."""
    return prefix_layout(messages, block_chars, max_blocks).keys


def key_positions(
    layout: PrefixLayout, prompt_len: int, media_spans: Sequence[tuple[int, int, int]], system_len: int = 0
) -> list[tuple[int, int]]:
    """``(key, t)`` per key: the prompt holds the key's block once its first ``t`` tokens are
    cached. ``media_spans``: the prompt's ``(start, length, item)`` token spans, one per media
    item of the layout in order; ``system_len``: tokens of the leading system message (0: none)."""
    if len(media_spans) != len(layout.media):
        raise ValueError(f"{len(media_spans)} media spans for {len(layout.media)} media items")
    anchors = [(0, 0)]
    if system_len and layout.system_end:
        anchors.append((layout.system_end, system_len))
    for (c0, c1), (start, length, _) in zip(layout.media, sorted(media_spans)):
        anchors += [(c0, start), (c1, start + length)]
    anchors.append((layout.total, prompt_len))
    anchors = sorted(set(anchors))
    media = set(layout.media)
    out: list[tuple[int, int]] = []
    j = 0
    for key, end in zip(layout.keys, layout.ends):
        while anchors[j + 1][0] < end:  # the segment (c0, c1] holding the block's end
            j += 1
        (c0, t0), (c1, t1) = anchors[j], anchors[j + 1]
        whole = c1 <= c0 or (c0, c1) in media  # a block ending inside an item needs all its rows
        t = t1 if whole else t0 + math.ceil((end - c0) * (t1 - t0) / (c1 - c0))
        out.append((key, max(1, min(prompt_len, t))))
    return out


def leading_held(held: Container[int] | None, blocks: Sequence[int]) -> int:
    """How many of ``blocks``, from the first, are in ``held`` (a replica's block keys)."""
    if not held:
        return 0
    n = 0
    for b in blocks:
        if b not in held:
            break
        n += 1
    return n
