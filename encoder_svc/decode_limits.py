"""One item's decode budgets, checked by the decoder itself between frames and blocks.

A decode runs in a worker thread, which cannot be killed: so the decoders call ``check()``
between sub-batches of frames (video) and blocks of samples (audio), and stop with a 413 once
the item's wall time (``decode_timeout_s``) is spent, or quietly once the encode that wanted the
frames is gone (``abandon()``: its requesters left, or another chunk failed). Decoded video
pixels are charged here too, per frame as they come out, so a stream whose later frames grow
past what its header said is stopped by the same budget its header was checked against.
"""

from __future__ import annotations

import contextvars
import threading
import time

from encoder_svc.errors import DecodeTooSlow, MediaTooLarge


# this video's share of its request's max_request_video_pixels (the gateway's header), if any
video_pixel_share: contextvars.ContextVar[int | None] = contextvars.ContextVar("video_pixel_share", default=None)


class Abandoned(Exception):
    """The decode's result is no longer wanted; raised in decoder threads, never answered."""


class DecodeGuard:
    def __init__(self, timeout_s: float, what: str = "media", max_pixels: int | None = None,
                 frame_pixels: int | None = None, pixels_setting: str = "max_video_pixels") -> None:
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.what = what
        self.max_pixels = max_pixels
        self.frame_pixels = frame_pixels
        self.pixels_setting = pixels_setting  # what max_pixels is, for the 413
        self.frame_pixels_hint: int | None = None  # width x height from the stream info, once probed
        self.pixels = 0  # decoded so far, all decoder threads together
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reason: MediaTooLarge | None = None  # the budget that stopped the decode, told to every thread

    @classmethod
    def for_video(cls, settings) -> DecodeGuard:
        share = video_pixel_share.get()
        if share is not None and share < settings.max_video_pixels:
            return cls(settings.decode_timeout_s, "video", share, settings.max_image_pixels,
                       "its share of the request's max_request_video_pixels")
        return cls(settings.decode_timeout_s, "video", settings.max_video_pixels, settings.max_image_pixels)

    def restart(self) -> None:
        """Start the wall-time clock now (the decode thread began; queueing is not decoding)."""
        self.deadline = time.monotonic() + self.timeout_s

    def abandon(self) -> None:
        """Nobody wants the result any more: decoder threads stop at their next ``check``."""
        self._stop.set()

    def _fail(self, err: MediaTooLarge) -> MediaTooLarge:
        """Stop every thread of this item with ``err`` (the first budget passed wins)."""
        with self._lock:
            if self._reason is None:
                self._reason = err
        self._stop.set()
        return err

    def raise_if_stopped(self) -> None:
        """Raises the budget that stopped this item (413), or ``Abandoned`` when its result is no
        longer wanted; nothing while it may go on."""
        if self._stop.is_set():
            r = self._reason
            raise type(r)(r.message) if r is not None else Abandoned()

    def check(self) -> None:
        """``raise_if_stopped``, and ``DecodeTooSlow`` (413) once the wall-time budget is spent."""
        self.raise_if_stopped()
        if time.monotonic() > self.deadline:
            raise self._fail(DecodeTooSlow(
                f"decoding the {self.what} took longer than decode_timeout_s={self.timeout_s:g} s and was stopped; "
                f"send a shorter or smaller {self.what}"
            ))

    def charge_frames(self, n: int, height: int, width: int) -> None:
        """Count ``n`` decoded frames of ``height`` x ``width`` against the budgets (413 past one)."""
        if self.frame_pixels is not None and height * width > self.frame_pixels:
            raise self._fail(MediaTooLarge(
                f"a video frame decoded to {width}x{height}; the limit is max_image_pixels={self.frame_pixels} "
                "pixels per frame"
            ))
        with self._lock:
            self.pixels += n * height * width
            over = self.max_pixels is not None and self.pixels > self.max_pixels
        if over:
            raise self._fail(MediaTooLarge(
                f"the video decoded to more than {self.pixels_setting}={self.max_pixels} pixels (sampled frames x "
                "width x height); send fewer frames (fps, max_frames) or a smaller resolution"
            ))


def check_video_size(settings, num_frames: int, width: int, height: int) -> None:
    """From the stream info, before decoding: the per-frame and per-item pixel budgets."""
    if width * height > settings.max_image_pixels:
        raise MediaTooLarge(f"video frames are {width}x{height}; the limit is max_image_pixels="
                            f"{settings.max_image_pixels} pixels per frame")
    total = num_frames * width * height
    what = f"the video would decode to {num_frames} sampled frames of {width}x{height} = {total} pixels"
    if total > settings.max_video_pixels:
        raise MediaTooLarge(
            f"{what}; the limit is max_video_pixels={settings.max_video_pixels}: send fewer frames (fps, max_frames) "
            "or a smaller resolution"
        )
    share = video_pixel_share.get()
    if share is not None and total > share:
        raise MediaTooLarge(
            f"{what}; its request's videos share max_request_video_pixels equally, and this one's share is {share}: "
            "send fewer, shorter or smaller videos in one request"
        )
