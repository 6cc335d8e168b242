"""Which frames of a video are encoded.

As HF's video processors (``BaseVideoProcessor.sample_frames``): ``F = int(n / video_fps * fps)``
frames, clamped to ``[1, min(max_frames, n)]``, at indices ``arange(0, n, n / F).int()``,
i.e. uniformly spaced from the first frame.
"""

from __future__ import annotations

import torch


def num_sampled(total: int, video_fps: float, fps: float, max_frames: int) -> int:
    if total < 1:
        raise ValueError("the video has no frames")
    f = int(total / video_fps * fps) if video_fps > 0 else max_frames
    return max(1, min(f, max_frames, total))


def sample_indices(total: int, video_fps: float, fps: float, max_frames: int) -> list[int]:
    f = num_sampled(total, video_fps, fps, max_frames)
    idx = torch.arange(0, total, total / f).int()[:f].tolist()
    assert len(idx) == f and idx == sorted(set(idx)) and 0 <= idx[0] and idx[-1] < total, idx
    return idx


def split_chunks(indices: list[int], num_chunks: int, max_chunk: int) -> list[list[int]]:
    """Consecutive runs of ``indices``: at least ``num_chunks`` (if there are enough frames),
    each at most ``max_chunk`` long, sizes differing by at most one."""
    if not indices:
        return []
    n = max(num_chunks, -(-len(indices) // max_chunk))
    n = min(n, len(indices))
    base, extra = divmod(len(indices), n)
    out, s = [], 0
    for c in range(n):
        size = base + (1 if c < extra else 0)
        out.append(indices[s : s + size])
        s += size
    return out
