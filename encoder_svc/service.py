"""The encode use case: validate -> cache lookup -> modality pipeline -> cache store.

Embedding definitions (the LLM service relies on them: rows == placeholder tokens):

* **image**: preprocessed exactly like the bundle's HF image processor (resize to the
  processor's size with its resample, antialiased, rescale 1/255, normalize mean/std), vision
  tower ``last_hidden_state`` -> projector -> ``[tokens_per_image, lm_hidden]``
  (mmserve: SigLIP + PoolProjector; gemma3: ``get_image_features``).
* **video**: ``F = int(n_frames / video_fps * fps)`` clamped to ``[1, min(max_frames, n_frames)]``
  frames at indices ``arange(0, n_frames, n_frames / F).int()`` (HF video processors' uniform
  sampling; ``fps``/``max_frames`` from the query, else the settings), each frame through the
  image path (same resize/normalize) ->
  ``[F, T, H]``; consecutive groups of ``video_temporal_pool`` frames are averaged (the last
  group padded by repeating the last frame) -> ``[ceil(F / pool) * T, lm_hidden]``.
* **MiMo-V2.5 omni** (``mimo_omni`` tower): an image is resized by the published processor's
  ``smart_resize`` (multiples of patch x merge within ``processor_config``'s pixel bounds,
  bilinear, ImageNet mean/std in 0..255) -> ``[(h/32)*(w/32), lm_hidden]``; a video's sampled
  frames (as above) are paired into temporal groups (the last repeated when odd), each group
  ``[(h/32)*(w/32), lm_hidden]``, concatenated; ``EncodeResult.segments`` gives each group's
  first-frame time and token count (the LLM writes ``MM:SS`` before each group).
* **audio**: decoded, mixed to mono, resampled to 16 kHz, split into 30 s windows; each window
  -> Whisper log-mel [n_mels, 3000] -> Whisper encoder (50 frames/s) -> PoolProjector seq1d
  (stride s) -> the first ``ceil(ceil(window_seconds * 50) / s)`` tokens; windows concatenated.
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import ModuleType

import torch

from encoder_svc.errors import BadMedia, MediaTooLarge, UnsupportedModality
from encoder_svc.metrics import EncoderMetrics
from encoder_svc.modalities import audio as audio_mod
from encoder_svc.modalities import image as image_mod
from encoder_svc.modalities import video as video_mod
from encoder_svc.modalities.context import EncodeContext
from shared.admission import Admission, AdmissionConfig
from shared.hashing import HASH_NAME, content_hash, media_key
from shared.schemas import EncodeParams, EncodeResult, MediaSegment

log = logging.getLogger(__name__)


def split_key(key: str) -> tuple[str, str, str, str] | None:
    """(model_id, modality, preprocessing hash, content hash) of a cache key, or None."""
    parts = key.rsplit(":", 3)
    if len(parts) != 4 or parts[1] not in ("image", "video", "audio"):
        return None
    return parts[0], parts[1], parts[2], parts[3]


SEGMENTS_SUFFIX = "#segments"  # cache entry beside an item's rows: its timestamped runs


def segments_to_tensor(segs: list[MediaSegment]) -> torch.Tensor:
    return torch.tensor([[g.start_s, float(g.num_tokens)] for g in segs], dtype=torch.float64)  # [G, 2]


def segments_from_tensor(t: torch.Tensor) -> list[MediaSegment]:
    return [MediaSegment(start_s=float(a), num_tokens=int(b)) for a, b in t.tolist()]


PIPELINES: dict[str, ModuleType] = {"image": image_mod, "video": video_mod, "audio": audio_mod}


class EncoderService:
    def __init__(self, ctx: EncodeContext, metrics: EncoderMetrics, cache=None) -> None:
        self.ctx = ctx
        self.metrics = metrics
        self.cache = cache
        self.model_name = ctx.settings.model_name or ctx.models.spec.name
        self._pipelines = PIPELINES
        self._inflight: dict[str, asyncio.Task] = {}  # cache key -> the one encode of it running
        self._waiters: dict[asyncio.Task, int] = {}  # an encode running -> requests awaiting it
        s = ctx.settings
        self.admission = Admission(AdmissionConfig(s.max_in_flight, s.max_queue, s.queue_timeout), "encoder")
        metrics.watch_admission(self.admission)

    def supported(self) -> list[str]:
        return [m for m in self.ctx.models.modalities() if m in self._pipelines]

    def cache_key(self, params: EncodeParams, digest: str) -> str:
        """``model_id:modality:preprocessing-hash:content_hash`` (see ``split_key``)."""
        sig = self._pipelines[params.modality].cache_signature(self.ctx, params)
        return media_key(self.ctx.models.model_id, params.modality, sig, digest)

    def validate(self, params: EncodeParams, body: bytes) -> str:
        """Checks that need no decoding; returns the content hash."""
        if params.modality not in self.supported():
            raise UnsupportedModality(
                f"modality {params.modality!r} is not supported by model {self.model_name!r}; "
                f"it accepts {self.supported()}",
                param="modality",
            )
        if len(body) > self.ctx.settings.max_media_bytes:
            raise MediaTooLarge(
                f"media is {len(body)} bytes; the limit is {self.ctx.settings.max_media_bytes} bytes"
            )
        if not body:
            raise BadMedia("the request body is empty; send the raw media bytes")
        digest = content_hash(body)
        if params.content_hash is not None and params.content_hash.lower() != digest:
            raise BadMedia(
                f"content_hash {params.content_hash!r} does not match the body ({HASH_NAME} {digest}); "
                "send the hash of the exact bytes or omit it",
                param="content_hash",
            )
        return digest

    async def encode(self, params: EncodeParams, body: bytes) -> tuple[torch.Tensor, EncodeResult]:
        t0 = time.perf_counter()
        try:
            embeds, result = await self._encode(params, body, t0)
        except Exception as e:
            status = getattr(e, "status", 500)
            self.metrics.requests.labels(params.modality, str(status)).inc()
            raise
        self.metrics.requests.labels(params.modality, "200").inc()
        self.metrics.latency.labels(params.modality).observe(time.perf_counter() - t0)
        return embeds, result

    async def _encode(self, params: EncodeParams, body: bytes, t0: float) -> tuple[torch.Tensor, EncodeResult]:
        digest = self.validate(params, body)
        key = self.cache_key(params, digest)
        cached = await self.cache.get(key, params.modality) if self.cache is not None else None
        if cached is not None:
            return cached, await self._result_of(params, body, digest, cached, True, t0, by_ref=params.by_ref)
        # Single flight: identical concurrent requests share one encode. It runs as its own
        # task, so a client that disconnects does not cancel the work others wait for; when the
        # last one has gone, nobody wants it and it is cancelled.
        task = self._inflight.get(key)
        shared = task is not None
        if task is None:
            task = asyncio.ensure_future(self._compute(params, body, key))
            self._inflight[key] = task
            task.add_done_callback(lambda t, k=key: self._finished(k, t))
        else:
            self.metrics.cache_lookups.labels("inflight", params.modality, "hit").inc()
        embeds, stored = await self._wait_for(task)
        # by reference only when the cache holds it: GET /v1/embeddings/{key} must find it
        return embeds, await self._result_of(params, body, digest, embeds, shared, t0, by_ref=params.by_ref and stored)

    async def _result_of(self, params: EncodeParams, body: bytes, digest: str, embeds: torch.Tensor, cached: bool,
                         t0: float, by_ref: bool = False) -> EncodeResult:
        """The header, with the item's timestamped runs when its pipeline has them (MiMo video)."""
        result = self._result(params, digest, embeds, cached, t0, by_ref)
        seg_fn = getattr(self._pipelines[params.modality], "segments", None)
        segs = await seg_fn(self.ctx, body, params, embeds) if seg_fn is not None else None
        return result.model_copy(update={"segments": segs}) if segs is not None else result

    async def _compute(self, params: EncodeParams, body: bytes, key: str) -> tuple[torch.Tensor, bool]:
        """The embeddings and whether a cache tier stored them."""
        embeds = await self._pipelines[params.modality].encode(self.ctx, body, params)
        embeds = embeds.detach().to("cpu").contiguous()
        assert embeds.ndim == 2 and embeds.shape[0] >= 1, embeds.shape  # [num_tokens, hidden]
        stored = False
        if self.cache is not None:
            seg_fn = getattr(self._pipelines[params.modality], "segments", None)
            segs = await seg_fn(self.ctx, body, params, embeds) if seg_fn is not None else None
            if segs is not None:  # beside the rows, for lookups by key that have no media bytes
                await self.cache.put(key + SEGMENTS_SUFFIX, params.modality, segments_to_tensor(segs))
            stored = await self.cache.put(key, params.modality, embeds)
        return embeds, stored

    async def _wait_for(self, task: asyncio.Task):
        """Await a (shared) encode as one of its requesters; the last requester to leave before it
        finished (cancelled: its client disconnected) cancels it, which stops its decode and drops
        its queued batcher items."""
        self._waiters[task] = self._waiters.get(task, 0) + 1
        try:
            return await asyncio.shield(task)
        finally:
            self._waiters[task] -= 1
            if not self._waiters[task]:
                del self._waiters[task]
                if not task.done():
                    task.cancel()
                    self.metrics.cancelled_encodes.inc()

    def _finished(self, key: str, task: asyncio.Task) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]
        if not task.cancelled():
            task.exception()  # retrieved: no "never retrieved" warning when nobody waits

    async def lookup(self, key: str) -> torch.Tensor | None:
        """A cached embedding by its full cache key (``GET /v1/embeddings/{key}``)."""
        if self.cache is None:
            return None
        parts = split_key(key)
        if parts is None:
            return None
        return await self.cache.get(key, parts[1])

    async def lookup_segments(self, key: str) -> tuple[bool, list[MediaSegment] | None]:
        """``(found, segments)`` stored beside a cached embedding: ``(True, None)`` when the
        modality has no segments here, ``(False, None)`` when they were (evicted)."""
        parts = split_key(key)
        if parts is None or parts[1] != "video" or not self.ctx.models.takes_patches:
            return True, None
        t = await self.cache.get(key + SEGMENTS_SUFFIX, parts[1]) if self.cache is not None else None
        return (t is not None), (segments_from_tensor(t) if t is not None else None)

    def _result(self, params: EncodeParams, digest: str, embeds: torch.Tensor, cached: bool, t0: float,
                by_ref: bool = False) -> EncodeResult:
        return EncodeResult(
            modality=params.modality,
            content_hash=digest,
            model=self.model_name,
            num_tokens=embeds.shape[0],
            hidden_size=embeds.shape[1],
            cached=cached,
            encode_ms=(time.perf_counter() - t0) * 1000.0,
            by_ref=by_ref,
        )

    def check_integrity(self) -> None:
        """Batcher and cache invariants (raises AssertionError); cheap enough for tests."""
        self.ctx.batcher.check_integrity()
        assert all(not t.done() for t in self._inflight.values()), "finished encodes left in flight"
        assert all(n > 0 for n in self._waiters.values()), "an encode kept with no requesters"
        if self.cache is not None:
            self.cache.check_integrity()
        self.admission.check_integrity()

    def close(self) -> None:
        self.ctx.batcher.close()
        if self.ctx.video_decoder is not None:
            self.ctx.video_decoder.close()
        self.ctx.cpu_pool.shutdown(wait=False, cancel_futures=True)
