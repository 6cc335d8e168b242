"""Chunked parallel decode: sampled indices split into chunks, each chunk decoded by its own
reader in a thread pool, chunks yielded in order. At most ``workers`` chunks are decoding (or
decoded, waiting) while the consumer holds one, so a long video never holds more than
``workers + 1`` chunks of decoded frames, never all of them."""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator

import torch

from encoder_svc.video.backends import VIDEO_BACKENDS, VideoInfo
from encoder_svc.video.sampling import split_chunks


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

    def probe(self, data: bytes) -> VideoInfo:
        return self._open(data).info()

    def _decode_chunk(self, data: bytes, indices: list[int]) -> torch.Tensor:
        return self._open(data).frames(indices)

    def iter_chunks(self, data: bytes, indices: list[int]) -> Iterator[tuple[list[int], torch.Tensor]]:
        """Yield ``(chunk_indices, frames uint8 [n, 3, H, W])`` in order; errors propagate."""
        chunks = split_chunks(indices, self.workers * self.chunks_per_worker, self.max_chunk)
        inflight: deque[tuple[list[int], Future]] = deque()
        todo = iter(chunks)
        try:
            for c in todo:
                inflight.append((c, self._pool.submit(self._decode_chunk, data, c)))
                if len(inflight) >= self.workers:
                    break
            while inflight:
                c, fut = inflight.popleft()
                frames = fut.result()
                nxt = next(todo, None)
                if nxt is not None:
                    inflight.append((nxt, self._pool.submit(self._decode_chunk, data, nxt)))
                assert frames.shape[0] == len(c), (frames.shape, len(c))
                yield c, frames
        finally:
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
