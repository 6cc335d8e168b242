"""Video decoder backends behind one interface (registry ``VIDEO_BACKENDS``: name -> reader class,
built on the video bytes); each reader is independent.

Frames come out as uint8 ``[n, 3, H, W]`` torch tensors, in the order of the indices asked for.
Readers use one decode thread each: parallelism comes from several readers on disjoint chunks
(decord and FFmpeg release the GIL), which measured faster than one multi-threaded reader.
"""

from __future__ import annotations

import io
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from encoder_svc.errors import BadMedia
from encoder_svc.errors import short_reason as _short
from shared.registry import Registry


@dataclass(frozen=True)
class VideoInfo:
    num_frames: int
    fps: float
    width: int
    height: int

    def __post_init__(self) -> None:
        if self.num_frames < 1 or self.width < 1 or self.height < 1:
            raise BadMedia(f"the video has no decodable frames ({self.num_frames} frames, {self.width}x{self.height})")


class VideoReader(ABC):
    """One open decoder over the video bytes."""

    @abstractmethod
    def info(self) -> VideoInfo: ...

    @abstractmethod
    def frames(self, indices: list[int]) -> torch.Tensor:
        """uint8 [len(indices), 3, H, W]; raises ``BadMedia`` if the data is corrupt."""

    def key_indices(self) -> list[int] | None:
        """Keyframe positions from the container's index (no decoding), or None if unknown."""
        return None


VIDEO_BACKENDS: Registry[Callable[[bytes], VideoReader]] = Registry("video backend")


def _header_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) of the video stream from the container's header (torchcodec reads the
    stream info without decoding a frame), or None if it does not say."""
    try:
        from torchcodec.decoders import VideoDecoder

        m = VideoDecoder(data, seek_mode="approximate").metadata
    except Exception:  # a container torchcodec cannot open: decord's own answer stands
        return None
    return (int(m.width), int(m.height)) if m.width and m.height else None


@VIDEO_BACKENDS.register("decord")
class DecordReader(VideoReader):
    name = "decord"

    def __init__(self, data: bytes) -> None:
        import decord

        self._data = data
        try:
            self._vr = decord.VideoReader(io.BytesIO(data), num_threads=1)
        except Exception as e:  # decord raises DECORDError / RuntimeError
            raise BadMedia(f"cannot decode the video: not a supported or an intact video file ({_short(e)})") from e

    def info(self) -> VideoInfo:
        # decord tells a frame's size only by decoding one: an 8K frame took 250 ms of CPU, spent
        # on a video the pixel budgets then refuse; the container's header says it for free
        size = _header_size(self._data)
        if size is None:
            h, w, _ = self._vr[0].shape if len(self._vr) else (0, 0, 0)
            size = (w, h)
        return VideoInfo(len(self._vr), float(self._vr.get_avg_fps()), *size)

    def key_indices(self) -> list[int] | None:
        try:
            return [int(i) for i in self._vr.get_key_indices()]
        except Exception:  # noqa: BLE001 - no index: the decode goes on without stepping stones
            return None

    def frames(self, indices: list[int]) -> torch.Tensor:
        try:
            arr = self._vr.get_batch(indices).asnumpy()  # [n, H, W, 3]
        except Exception as e:
            raise BadMedia(f"the video is corrupt or truncated: frames {indices[0]}..{indices[-1]} failed ({_short(e)})") from e
        return torch.from_numpy(arr).permute(0, 3, 1, 2)


@VIDEO_BACKENDS.register("torchcodec")
class TorchcodecReader(VideoReader):
    name = "torchcodec"

    def __init__(self, data: bytes) -> None:
        from torchcodec.decoders import VideoDecoder

        try:
            self._dec = VideoDecoder(data, num_ffmpeg_threads=1, dimension_order="NCHW", seek_mode="exact")
        except Exception as e:
            raise BadMedia(f"cannot decode the video: not a supported or an intact video file ({_short(e)})") from e

    def info(self) -> VideoInfo:
        m = self._dec.metadata
        return VideoInfo(int(m.num_frames or 0), float(m.average_fps or 0.0), int(m.width or 0), int(m.height or 0))

    def key_indices(self) -> list[int] | None:
        try:  # private in torchcodec 0.17; without it the decode goes on without stepping stones
            return [int(i) for i in self._dec._get_key_frame_indices().tolist()]
        except Exception:  # noqa: BLE001
            return None

    def frames(self, indices: list[int]) -> torch.Tensor:
        try:
            return self._dec.get_frames_at(indices).data  # [n, 3, H, W]
        except Exception as e:
            raise BadMedia(f"the video is corrupt or truncated: frames {indices[0]}..{indices[-1]} failed ({_short(e)})") from e

