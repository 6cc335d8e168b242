"""The per-request video pixel budget, split by the gateway and carried to each encoder call.

The gateway's ``max_request_video_pixels`` covers all videos of one request; items are encoded
concurrently, on different replicas, so each video's encode gets an equal share in a header and
its encoder refuses (413) a video whose sampled frames would decode past it.
"""

from __future__ import annotations

VIDEO_PIXEL_SHARE_HEADER = "x-mmserve-video-pixel-share"


def video_share(budget: int | None, num_videos: int) -> int | None:
    """Each of ``num_videos`` videos' share of ``budget`` (None: no budget or no video)."""
    if not budget or num_videos < 1:
        return None
    return max(1, budget // num_videos)


def parse_share(value: str | None) -> int | None:
    """The header's share, or None when absent or not a positive integer (then the item budget alone holds)."""
    if value is None or not value.strip().isdigit():
        return None
    n = int(value.strip())
    return n if n > 0 else None
