"""Which frames a guarded decode asks for, and in which calls, so no call runs long.

A decoder reaches a sampled frame by decoding forward from the keyframe at or before it (or from
where it stands): for a video with one keyframe, frame 36,000 is 36,000 frames of decoding inside
one uninterruptible call. With the stream's keyframe positions, stepping stones are asked for on
the way (frames the decoder must decode anyway, converted and dropped), so every call decodes at
most ``work_pixels`` worth of frames and the guard is checked between calls. The targets' pixels
are unchanged: the stones only split the same forward decode into pieces.
"""

from __future__ import annotations

from bisect import bisect_right


def _key_before(keys: list[int], i: int) -> int:
    """The last keyframe at or before ``i`` (0 when none is listed)."""
    j = bisect_right(keys, i)
    return keys[j - 1] if j else 0


def _cost(i: int, prev: int, keys: list[int] | None) -> int:
    """Frames decoded to reach ``i`` with the decoder after ``prev`` (-1: fresh)."""
    start = prev + 1 if keys is None else max(prev + 1, _key_before(keys, i))
    return max(1, i - start + 1)


def plan_calls(targets: list[int], keys: list[int] | None, frame_pixels: int, work_pixels: int,
               max_frames_per_call: int, after: int = -1) -> list[list[int]]:
    """Sorted ``targets`` (and the stones between them) grouped into decoder calls, each decoding
    about ``work_pixels`` at most (one frame's decode when frames are larger) and returning at most
    ``max_frames_per_call`` frames; ``after``: the last frame the decoder returned (-1: fresh).
    Without ``keys`` no stones are added: a stone could force decoding a seek would have skipped."""
    stride = max(1, work_pixels // max(1, frame_pixels))  # frames one call may decode
    points, prev = [], after
    for t in targets:
        if keys:
            start = max(prev + 1, _key_before(keys, t))
            points.extend(range(start + stride - 1, t, stride))  # stones: every stride-th frame on the way
        points.append(t)
        prev = t
    calls: list[list[int]] = []
    call, work, prev = [], 0, after
    for p in points:
        c = _cost(p, prev, keys or None)
        if call and (work + c > stride or len(call) >= max_frames_per_call):
            calls.append(call)
            call, work = [], 0
        call.append(p)
        work += c
        prev = p
    if call:
        calls.append(call)
    return calls
