"""Chunked parallel decode: sampled indices split into chunks, each chunk decoded by its own
reader in a thread pool, chunks yielded in order. At most ``workers`` chunks are decoding (or
decoded, waiting) while the consumer holds one, so a long video never holds more than
``workers + 1`` chunks of decoded frames, never all of them.

With a ``DecodeGuard`` each chunk is decoded in sub-batches of about ``SUB_BATCH_PIXELS``, and
the guard is checked between them: decoded pixels are charged, a decode past its wall time or
one nobody waits for stops there (one sub-batch, a seek included, is the part that cannot be
interrupted)."""

from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator

import torch

from encoder_svc.decode_limits import DecodeGuard
from encoder_svc.video.backends import VIDEO_BACKENDS, VideoInfo
from encoder_svc.video.sampling import split_chunks

SUB_BATCH_PIXELS = 16_000_000  # ~8 1080p frames: ~0.1-0.2 s of decoding between guard checks here


class ChunkedVideoDecoder:
    def __init__(self, backend: str = "decord", workers: int = 0, max_chunk: int = 32, chunks_per_worker: int = 2) -> None:
        if max_chunk < 1 or chunks_per_worker < 1:
            raise ValueError("max_chunk and chunks_per_worker must be >= 1")
        self.backend = backend
        self._open = VIDEO_BACKENDS.get(backend)
        self.workers = workers or os.cpu_count() or 1
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
        parts, i, step = [], 0, 1  # the first frame alone tells the size the sub-batches are cut by
        while i < len(indices):
            guard.check()
            part = reader.frames(indices[i : i + step])  # [n, 3, H, W]
            self._count(part.shape[0])
            guard.charge_frames(part.shape[0], part.shape[-2], part.shape[-1])
            parts.append(part)
            i += step
            step = max(1, SUB_BATCH_PIXELS // max(1, part.shape[-2] * part.shape[-1]))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

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
