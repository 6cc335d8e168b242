"""Chunked parallel decode: sampled indices split into chunks, each chunk decoded by its own
reader in a thread pool, chunks yielded in order. At most ``workers`` chunks are decoding (or
decoded, waiting) while the consumer holds one, so a long video never holds more than
``workers + 1`` chunks of decoded frames, never all of them.

With a ``DecodeGuard`` each chunk is decoded in calls that each decode about
``CALL_WORK_PIXELS`` (stepping stones split a long forward decode, ``stepping.py``), and the
guard is checked between calls: decoded pixels are charged, a decode past its wall time or one
nobody waits for stops there. Without keyframe positions from the container a call's seek is
the part that cannot be interrupted."""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator

import torch

from encoder_svc.decode_limits import DecodeGuard
from encoder_svc.video.backends import VIDEO_BACKENDS, VideoInfo
from encoder_svc.video.sampling import split_chunks
from encoder_svc.video.stepping import plan_calls
from shared.cpus import usable_cpus

SUB_BATCH_PIXELS = 16_000_000  # frames one decoder call returns: ~8 1080p frames
CALL_WORK_PIXELS = 64_000_000  # frames one call decodes (stones included): 0.3-0.7 s here at 94-216 Mpx/s


class ChunkedVideoDecoder:
    def __init__(self, backend: str = "decord", workers: int = 0, max_chunk: int = 32, chunks_per_worker: int = 2) -> None:
        if max_chunk < 1 or chunks_per_worker < 1:
            raise ValueError("max_chunk and chunks_per_worker must be >= 1")
        self.backend = backend
        self._open = VIDEO_BACKENDS.get(backend)
        self.workers = workers or usable_cpus()
        self.max_chunk = max_chunk
        # more chunks than threads: a thread that gets less CPU (a shared machine) takes fewer chunks
        self.chunks_per_worker = chunks_per_worker
        self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix=f"video-{backend}")
        self._count_lock = threading.Lock()
        self.decoded_frames = 0  # frames decoded so far, all videos: shows a stopped decode stays stopped

    def _count(self, n: int) -> None:
        with self._count_lock:
            self.decoded_frames += n

    def probe(self, data: bytes) -> VideoInfo:
        return self._open(data).info()

    def _decode_chunk(self, data: bytes, indices: list[int], guard: DecodeGuard | None) -> torch.Tensor:
        if guard is None:
            frames = self._open(data).frames(indices)
            self._count(frames.shape[0])
            return frames
        guard.check()  # queued behind other chunks: the budget may be spent or the decode abandoned
        reader = self._open(data)
        keys = reader.key_indices()
        parts, after, todo = [], -1, indices
        frame_pixels = guard.frame_pixels_hint
        if frame_pixels is None:  # the first frame alone tells the size the calls are cut by
            parts.append(self._guarded_call(reader, guard, indices[:1], indices[:1]))
            frame_pixels = parts[0].shape[-2] * parts[0].shape[-1]
            after, todo = indices[0], indices[1:]
        max_frames = max(1, SUB_BATCH_PIXELS // frame_pixels)
        wanted = set(indices)
        for call in plan_calls(todo, keys, frame_pixels, CALL_WORK_PIXELS, max_frames, after):
            parts.append(self._guarded_call(reader, guard, call, [i for i in call if i in wanted]))
        parts = [p for p in parts if p.shape[0]]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _guarded_call(self, reader, guard: DecodeGuard, call: list[int], keep: list[int]) -> torch.Tensor:
        """Decode ``call`` (targets and stepping stones) in one decoder call after a guard check;
        the frames of ``keep`` (uint8 [len(keep), 3, H, W]), charged to the guard."""
        guard.check()
        frames = reader.frames(call)  # [len(call), 3, H, W]
        if len(keep) != len(call):
            pos = {i: j for j, i in enumerate(call)}
            frames = frames[[pos[i] for i in keep]]
        if keep:
            self._count(len(keep))
            guard.charge_frames(len(keep), frames.shape[-2], frames.shape[-1])
        return frames

    def iter_chunks(self, data: bytes, indices: list[int],
                    guard: DecodeGuard | None = None) -> Iterator[tuple[list[int], torch.Tensor]]:
        """Yield ``(chunk_indices, frames uint8 [n, 3, H, W])`` in order; errors propagate. With
        ``guard``, its budgets hold (413) and leaving the iterator early stops the other chunks."""
        chunks = split_chunks(indices, self.workers * self.chunks_per_worker, self.max_chunk)
        inflight: deque[tuple[list[int], Future]] = deque()
        todo = iter(chunks)
        try:
            for c in todo:
                inflight.append((c, self._pool.submit(self._decode_chunk, data, c, guard)))
                if len(inflight) >= self.workers:
                    break
            while inflight:
                c, fut = inflight.popleft()
                frames = fut.result()
                nxt = next(todo, None)
                if nxt is not None:
                    inflight.append((nxt, self._pool.submit(self._decode_chunk, data, nxt, guard)))
                assert frames.shape[0] == len(c), (frames.shape, len(c))
                yield c, frames
        finally:
            if inflight and guard is not None:
                guard.abandon()  # left early (error, cancel): chunks already decoding stop at their next check
            for _, fut in inflight:
                fut.cancel()

    def decode(self, data: bytes, indices: list[int]) -> torch.Tensor:
        """All requested frames at once, uint8 [len(indices), 3, H, W] (tests, benchmarks)."""
        return torch.cat([f for _, f in self.iter_chunks(data, indices)])

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def decode_sequential(backend: str, data: bytes, indices: list[int]) -> torch.Tensor:
    """One reader, all indices: the baseline chunked decoding must equal."""
    return VIDEO_BACKENDS.get(backend)(data).frames(indices)
