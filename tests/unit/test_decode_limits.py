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


def _work(calls, keys, after=-1):
    """Frames each call decodes: forward from the previous frame, or from the keyframe before."""
    from encoder_svc.video.stepping import _key_before

    out, prev = [], after
    for call in calls:
        w = 0
        for i in call:
            w += i - (max(prev + 1, _key_before(keys, i)) if keys else prev + 1) + 1
            prev = i
        out.append(w)
    return out


def test_stepping_stones_cut_a_long_forward_decode_into_bounded_calls():
    from encoder_svc.video.stepping import plan_calls

    px = 1280 * 720
    stride = 64_000_000 // px  # 69 frames of 720p per call
    targets = [10, 5000, 5010, 9000]
    calls = plan_calls(targets, [0], px, 64_000_000, 8)  # one keyframe: frame 9000 is 9000 frames away
    flat = [i for c in calls for i in c]
    assert flat == sorted(flat) and [i for i in flat if i in targets] == targets
    assert max(_work(calls, [0])) <= stride and len(calls) > 9000 // stride
    # a keyframe just before a target: the decoder seeks there, no stones before it
    calls = plan_calls([9000], [0, 8990], px, 64_000_000, 8)
    assert calls == [[9000]]
    # no keyframe positions: no stones (one could force decoding a seek would skip)
    assert plan_calls([10, 9000], None, px, 64_000_000, 8) == [[10], [9000]]
    # close targets share a call, up to the frames a call may return
    assert plan_calls(list(range(20)), [0], px, 64_000_000, 8) == [list(range(8)), list(range(8, 16)), list(range(16, 20))]
    # frames larger than the work budget: one frame per call
    assert plan_calls([0, 1, 2], [0], 64_000_000, 64_000_000, 8) == [[0], [1], [2]]
