"""Decode budgets: the guard decoders check between frames / blocks, and the audio budgets on
real files made by ffmpeg (FFmpeg's and libsndfile's decoders)."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest

from encoder_svc.decode_limits import Abandoned, DecodeGuard
from encoder_svc.errors import DecodeTooSlow, MediaTooLarge
from encoder_svc.preprocess.audio_decode import AudioLimits, decode_audio

pytestmark = pytest.mark.unit


def ffmpeg(out, *args: str) -> bytes:
    subprocess.run(["ffmpeg", "-loglevel", "error", "-y", *args, str(out)], check=True)
    return out.read_bytes()


def test_past_its_wall_time_every_thread_of_the_item_stops_with_the_413():
    g = DecodeGuard(0.05, "video")
    g.check()
    time.sleep(0.1)
    with pytest.raises(DecodeTooSlow, match=r"decode_timeout_s=0.05 s and was stopped"):
        g.check()
    errors = []

    def other_thread():
        try:
            g.check()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert isinstance(errors[0], DecodeTooSlow)  # the reason, not a bare "abandoned"


def test_abandoned_decode_stops_quietly_and_restart_moves_the_clock():
    g = DecodeGuard(0.05)
    time.sleep(0.1)
    g.restart()
    g.check()  # the clock starts when the decode thread does, not when it was queued
    g.abandon()
    with pytest.raises(Abandoned):
        g.check()


def test_pixels_charged_per_frame_against_both_budgets():
    g = DecodeGuard(60, "video", max_pixels=100, frame_pixels=40)
    g.charge_frames(2, 5, 8)
    with pytest.raises(MediaTooLarge, match="max_image_pixels=40"):
        g.charge_frames(1, 7, 7)
    with pytest.raises(MediaTooLarge, match="max_image_pixels=40"):
        g.check()  # the first failure stops the item's other threads with it
    g2 = DecodeGuard(60, "video", max_pixels=100, frame_pixels=40)
    g2.charge_frames(2, 5, 8)
    with pytest.raises(MediaTooLarge, match="max_video_pixels=100"):
        g2.charge_frames(1, 5, 8)


@pytest.fixture(scope="module")
def audio(tmp_path_factory):
    d = tmp_path_factory.mktemp("audio")
    ten_s = ["-f", "lavfi", "-i", "sine=frequency=300:duration=10:sample_rate=16000"]
    return {
        "flac": ffmpeg(d / "a.flac", *ten_s, "-c:a", "flac"),
        # Matroska written to a pipe: no duration in its header (Opus decodes at 48 kHz)
        "mka": ffmpeg(d / "a.mka", *ten_s, "-c:a", "libopus", "-f", "matroska"),
        "stereo": ffmpeg(d / "s.flac", "-f", "lavfi", "-i", "sine=duration=1:sample_rate=48000", "-ac", "2"),
    }


def test_audio_samples_budget_from_the_header_and_without_one(audio, tmp_path):
    with pytest.raises(MediaTooLarge, match=r"160000 samples x 1 channels; the limit is max_audio_samples=100000"):
        decode_audio(audio["flac"], limits=AudioLimits(100_000, 3_072_000))
    piped = tmp_path / "piped.mka"
    subprocess.run(f"ffmpeg -loglevel error -y -i - -c copy -f matroska pipe:1 > {piped}", shell=True,
                   input=audio["mka"], check=True)
    from torchcodec.decoders import AudioDecoder

    assert AudioDecoder(piped.read_bytes()).metadata.duration_seconds_from_header is None
    with pytest.raises(MediaTooLarge, match=r"audio is over \d+ samples x 1 channels; the limit is max_audio_samples"):
        decode_audio(piped.read_bytes(), limits=AudioLimits(100_000, 3_072_000))
    assert decode_audio(piped.read_bytes()).numel() == 160_000  # within the default: 10 s at 16 kHz


def test_audio_rate_times_channels_budget(audio):
    with pytest.raises(MediaTooLarge, match=r"48000 Hz x 2 channels = 96000 samples per second; the limit is "
                                            r"max_audio_samples_per_second=95999"):
        decode_audio(audio["stereo"], limits=AudioLimits(10**9, 95_999))
    assert decode_audio(audio["stereo"], limits=AudioLimits(96_000, 96_000)).numel() == 16_000


def test_audio_decode_past_its_wall_time_stopped(audio):
    g = DecodeGuard(0.0, "audio")
    with pytest.raises(DecodeTooSlow, match="decoding the audio took longer than decode_timeout_s=0 s"):
        decode_audio(audio["flac"], guard=g)
