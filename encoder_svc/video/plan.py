"""Before a video is decoded: its stream info, the frames to sample, the budgets they must fit."""

from __future__ import annotations

from encoder_svc.decode_limits import DecodeGuard, check_video_size
from encoder_svc.video.backends import VideoInfo
from encoder_svc.video.decode import ChunkedVideoDecoder
from encoder_svc.video.sampling import sample_indices


def plan(settings, decoder: ChunkedVideoDecoder, data: bytes, fps: float,
         max_frames: int) -> tuple[DecodeGuard, VideoInfo, list[int]]:
    """``(guard, info, sampled indices)``; raises ``MediaTooLarge`` (413) when the sampled frames
    would pass ``max_image_pixels`` / ``max_video_pixels``. Runs in the decode thread: the item's
    ``decode_timeout_s`` clock starts here."""
    guard = DecodeGuard.for_video(settings)
    info = decoder.probe(data)
    indices = sample_indices(info.num_frames, info.fps, fps, max_frames)
    check_video_size(settings, len(indices), info.width, info.height)
    guard.frame_pixels_hint = info.width * info.height
    guard.check()
    return guard, info, indices
