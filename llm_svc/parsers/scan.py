"""Text helpers for tag-delimited formats: find the next tag, and how much of a buffer's tail
could still be the start of one (that much is held back)."""

from __future__ import annotations


def find_tag(buf: str, tags: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest occurrence of any of ``tags`` in ``buf`` (position, tag), or None."""
    best = None
    for tag in tags:
        i = buf.find(tag)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, tag)
    return best


def partial_tail(buf: str, tags: tuple[str, ...]) -> int:
    """Length of the longest proper suffix of ``buf`` that is a prefix of one of ``tags``."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(buf)), best, -1):
            if tag.startswith(buf[-n:]):
                best = n
                break
    return best
