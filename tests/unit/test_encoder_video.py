"""Video sampling, temporal pooling and chunked parallel decode vs one sequential reader."""

from __future__ import annotations

import subprocess

import pytest
import torch

from encoder_svc.errors import BadMedia
from encoder_svc.modalities.video import temporal_pool
from encoder_svc.video.backends import VIDEO_BACKENDS
from encoder_svc.video.decode import ChunkedVideoDecoder, decode_sequential
from encoder_svc.video.sampling import num_sampled, sample_indices, split_chunks

pytestmark = pytest.mark.unit


def make_video(path, codec: str, seconds: float = 4, size: str = "160x120", rate: int = 30) -> bytes:
    args = {"h264": ["-c:v", "libx264", "-pix_fmt", "yuv420p", "-g", "30", "-bf", "2"],
            "vp9": ["-c:v", "libvpx-vp9", "-b:v", "300k", "-deadline", "realtime", "-cpu-used", "8"]}[codec]
    subprocess.run(
        ["ffmpeg", "-loglevel", "error", "-y", "-f", "lavfi", "-i", f"testsrc=size={size}:rate={rate}",
         "-t", str(seconds), *args, str(path)],
        check=True,
    )
    return path.read_bytes()


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    d = tmp_path_factory.mktemp("videos")
    return {"h264": make_video(d / "v.mp4", "h264"), "vp9": make_video(d / "v.webm", "vp9")}


def test_sampling_matches_hf_formula():
    # HF BaseVideoProcessor.sample_frames: num = int(total / fps * sample_fps); arange(0, total, total/num)
    for total, vfps, fps, cap in [(150, 30, 1.0, 32), (150, 30, 2.0, 4), (7, 30, 1.0, 32), (3000, 25, 0.5, 16), (90, 30, 30, 500)]:
        num = max(1, min(int(total / vfps * fps), cap, total))
        want = torch.arange(0, total, total / num).int()[:num].tolist()
        assert sample_indices(total, vfps, fps, cap) == want
        assert len(want) == num_sampled(total, vfps, fps, cap)
    assert sample_indices(7, 30, 1.0, 32) == [0]  # shorter than one sampling interval: one frame


def test_split_chunks_covers_in_order():
    idx = list(range(0, 300, 3))
    for n, cap in [(2, 32), (4, 8), (1, 1000), (200, 5)]:
        chunks = split_chunks(idx, n, cap)
        assert [i for c in chunks for i in c] == idx
        assert all(0 < len(c) <= cap for c in chunks)
        assert len(chunks) >= min(n, len(idx))
        assert max(map(len, chunks)) - min(map(len, chunks)) <= 1


def test_temporal_pool_known_answer():
    frames = torch.arange(5, dtype=torch.float32).reshape(5, 1, 1).expand(5, 2, 3)  # frame f is all f
    out = temporal_pool(frames, 2)
    assert out.shape == (3, 2, 3)
    assert out[:, 0, 0].tolist() == [0.5, 2.5, 4.0]  # last group pads by repeating frame 4
    assert torch.equal(temporal_pool(frames, 1), frames)


@pytest.mark.parametrize("backend", sorted(VIDEO_BACKENDS))
@pytest.mark.parametrize("codec", ["h264", "vp9"])
def test_chunked_parallel_equals_sequential(videos, backend, codec):
    data = videos[codec]
    dec = ChunkedVideoDecoder(backend, workers=2, max_chunk=7)
    try:
        info = dec.probe(data)
        assert (info.num_frames, round(info.fps), info.width, info.height) == (120, 30, 160, 120)
        idx = sample_indices(info.num_frames, info.fps, 10.0, 64)
        assert len(idx) == 40
        chunked = dec.decode(data, idx)
        seq = decode_sequential(backend, data, idx)
        assert chunked.shape == (40, 3, 120, 160) and chunked.dtype == torch.uint8
        assert torch.equal(chunked, seq)
        assert not torch.equal(chunked[0], chunked[-1])  # testsrc moves: frames differ
    finally:
        dec.close()


def test_backends_agree_on_h264(videos):
    idx = [0, 17, 55, 119]
    a = decode_sequential("decord", videos["h264"], idx)
    b = decode_sequential("torchcodec", videos["h264"], idx)
    assert (a.int() - b.int()).abs().max() <= 2  # both FFmpeg-based; colour conversion may differ by rounding


def test_chunks_stream_with_bounded_inflight(videos):
    dec = ChunkedVideoDecoder("decord", workers=2, max_chunk=4)
    try:
        seen = []
        for c, frames in dec.iter_chunks(videos["h264"], list(range(0, 120, 4))):
            assert frames.shape[0] == len(c) <= 4
            seen += c
        assert seen == list(range(0, 120, 4))
    finally:
        dec.close()


@pytest.mark.parametrize("backend", sorted(VIDEO_BACKENDS))
def test_corrupt_video_is_bad_media(videos, backend):
    dec = ChunkedVideoDecoder(backend, workers=2)
    try:
        with pytest.raises(BadMedia):
            dec.probe(b"\x00\x00\x00\x18ftypmp42" + b"junk" * 100)
        with pytest.raises(BadMedia):
            dec.probe(videos["h264"][: len(videos["h264"]) // 2])  # moov atom at the end is cut off
    finally:
        dec.close()


def test_decoded_frames_held_at_once_are_bounded(videos):
    """With a slow consumer, decoded chunks alive at once stay <= workers + 1, however long the video."""
    import threading
    import time

    dec = ChunkedVideoDecoder("decord", workers=2, max_chunk=3, chunks_per_worker=2)
    lock = threading.Lock()
    held = {"now": 0, "max": 0}
    real = dec._decode_chunk

    def counting(data, indices, guard):
        frames = real(data, indices, guard)
        with lock:
            held["now"] += 1
            held["max"] = max(held["max"], held["now"])
        return frames

    dec._decode_chunk = counting
    try:
        n = 0
        for c, frames in dec.iter_chunks(videos["h264"], list(range(0, 120, 3))):
            time.sleep(0.02)  # the encoder is slower than the decoder
            n += len(c)
            with lock:
                held["now"] -= 1
        assert n == 40 and held["max"] <= dec.workers + 1, held  # in flight + the one consumed
    finally:
        dec.close()
