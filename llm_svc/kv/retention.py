"""Where the prefix cache keeps dense SWA windows for a prompt (the seed's "medium/short
sequence SWA retention"): at the end of the system message, where conversations sharing it
branch off, and every ``interval`` tokens of prompts up to ``max_len`` tokens, where agent and
tool-call turns re-send a shared head. Each point costs one window of SWA KV per cached prompt."""

from __future__ import annotations


def retention_points(prompt_len: int, system_len: int, interval: int, max_len: int) -> list[int]:
    """Sorted positions in ``(0, prompt_len)``: ``system_len`` (if any) and the multiples of
    ``interval`` when ``prompt_len <= max_len`` (``interval`` 0: none)."""
    points = set()
    if 0 < system_len < prompt_len:
        points.add(system_len)
    if interval > 0 and prompt_len <= max_len:
        points.update(range(interval, prompt_len, interval))
    return sorted(points)
