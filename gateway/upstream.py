"""Clients of the encoder and LLM services over one shared ``httpx.AsyncClient``.

Failure policy (the protocol in ``shared.schemas``):

* a 4xx from the encoder means the media is bad -> ``MediaError`` (400 naming the item);
* a 4xx from the LLM means the request is bad (e.g. prompt too long) -> 400 with its message,
  except 409 ``media_unavailable`` (embeddings sent by reference were gone when the LLM fetched
  them) -> ``MediaUnavailable``, which the chat route answers by re-sending by value;
* a 429 (the replica is overloaded) -> 429 with its ``Retry-After``: more load elsewhere would
  not help a saturated stack, the client backs off;
* only connection errors and 503 (not serving: loading, restarting) are retried, on the next
  distinct replica after a jittered backoff; any other 5xx or a timeout is answered at once
  (retrying work that failed or timed out multiplies load on an overloaded stack);
  when every attempt fails -> ``UpstreamError`` (502, or 503 when no replica exists);
* a replica the pool finds unreachable (silent probes: a host cut off) ends every wait on it:
  a request it had not answered yet is retried on another replica, a generation already
  streaming ends with an error (``gateway.routing.inflight``);
* a pooled connection that drops before any answer (reset, or closed by the server's keep-alive
  timer as the request went out) is retried once more on the same replica: that replica is
  fine, and with a single replica there is no other to try.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

import anyio
import httpx

from gateway.errors import APIError
from gateway.aio import gather_or_cancel
from gateway.media.items import MediaError, MediaItem
from gateway.routing.capacity import ReplicaLimits, estimate_prompt_tokens
from gateway.routing.encoder_ring import EncoderRing
from gateway.routing.inflight import InFlightWaits, ReplicaLost
from gateway.routing.llm_router import LLMRouter
from gateway.routing.pairing import PrefillPairing
from shared.prefix_keys import prefix_blocks
from gateway.routing.replicas import ReplicaPool
from shared.admission import deadline_header
from shared.schemas import EncodeResult, GenerateChunk, GenerateRequest, GenerateResponse, PromptText
from shared.video_budget import VIDEO_PIXEL_SHARE_HEADER, video_share
from shared.rawwire import SAFETENSORS_MIME, RawTensor, RawWireError, unpack_raw

log = logging.getLogger("mmserve.gateway.upstream")

# the monotonic deadline of the client request being served (set by the chat route)
upstream_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("upstream_deadline", default=None)
RETRY_BASE_S = 0.025  # first retry waits U(0, 25 ms), then U(0, 50 ms), ...
LOST_MID_GENERATION = ("the LLM replica serving this request stopped answering mid-generation (it was found "
                       "unreachable); the output so far is incomplete: retry the request")
# the connection failed, or broke before a response: another replica may well serve it
_CONNECTION_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.NetworkError)
# ... of those, the ones where the replica was reached: the connection dropped before an answer
_DROPPED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
DROPPED_RETRIES = 1  # extra attempts on the same replica after a dropped connection, per call
DRAIN_S = 0.5  # the longest a finished stream waits for the end of its body (it follows the last chunk)


async def backoff(attempt: int) -> None:
    """Full-jitter exponential backoff before retry ``attempt`` (1, 2, ...)."""
    await asyncio.sleep(random.uniform(0.0, RETRY_BASE_S * (2 ** (attempt - 1))))


def overloaded(response: httpx.Response, service: str) -> APIError:
    """A replica's 429 as the gateway's own 429, keeping its ``Retry-After``."""
    retry_after = response.headers.get("retry-after", "1")
    return APIError(
        429, f"the {service} service is overloaded: {error_text(response)}", code="overloaded",
        headers={"Retry-After": retry_after},
    )


class UpstreamError(APIError):
    """Every replica of a service failed (or none exists)."""

    def __init__(self, message: str, status: int = 502) -> None:
        super().__init__(status, message, type="upstream_error", code="upstream_unavailable")


class _Retry(Exception):
    """One attempt failed in a way another replica may not; ``dropped``: the connection broke
    before any answer, so the same replica may well serve a second try."""

    def __init__(self, message: str, dropped: bool = False) -> None:
        super().__init__(message)
        self.dropped = dropped


def _dropped(e: Exception) -> _Retry:
    return _Retry(f"{type(e).__name__}: {e}", dropped=isinstance(e, _DROPPED))


class MediaUnavailable(APIError):
    """The LLM could not fetch embeddings sent by reference (evicted, encoder gone)."""

    def __init__(self, message: str) -> None:
        super().__init__(502, message, type="upstream_error", code="media_unavailable")


MEDIA_UNAVAILABLE = "media_unavailable"  # the LLM's error code for it (HTTP 409)
MAX_SOURCES = 3  # encoders named per item by reference: the one that encoded it, then others


def error_code(response: httpx.Response) -> str | None:
    """``error.code`` of an OpenAI-style error body, if any."""
    try:
        body = response.json()
    except (ValueError, httpx.ResponseNotRead):
        return None
    err = body.get("error") if isinstance(body, dict) else None
    return err.get("code") if isinstance(err, dict) else None


def error_text(response: httpx.Response) -> str:
    """The message of an error response: OpenAI ``error.message``, FastAPI ``detail`` or text."""
    try:
        body = response.json()
    except (ValueError, httpx.ResponseNotRead):  # not JSON, or the body could not be read
        try:
            return response.text[:500] or f"HTTP {response.status_code}"
        except httpx.ResponseNotRead:
            return f"HTTP {response.status_code}"
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        if "detail" in body:
            d = body["detail"]
            return d if isinstance(d, str) else json.dumps(d)[:500]
    return json.dumps(body)[:500]


@dataclass(frozen=True)
class Encoded:
    """An item as encoded by the replica that served it: by reference (``embeds`` None, the
    encoders in ``sources`` serve ``result.key``) or by value (``embeds`` [num_tokens, hidden])."""

    item: MediaItem
    result: EncodeResult
    replica: str
    embeds: RawTensor | None = field(default=None, repr=False)
    sources: tuple[str, ...] = ()

    @property
    def by_ref(self) -> bool:
        return self.embeds is None

    @property
    def num_tokens(self) -> int:
        return self.result.num_tokens


class EncoderClient:
    """Encodes items on the ring owner of their content hash, falling over along the ring."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        pool: ReplicaPool,
        ring: EncoderRing,
        *,
        attempts: int,
        timeout: httpx.Timeout,
        on_failover: Callable[[], None] = lambda: None,
        load_factor: float = 1.5,
        max_request_video_pixels: int | None = None,
    ) -> None:
        self._client = client
        self._pool = pool
        self._ring = ring
        self.attempts = attempts
        self.timeout = timeout
        self._on_failover = on_failover
        self.load_factor = load_factor
        self.max_request_video_pixels = max_request_video_pixels  # split over a request's videos
        self._in_flight: dict[str, int] = {}  # node -> encodes sent and not answered
        self.waits = InFlightWaits()
        pool.on_lost(self.waits.lose)

    def load(self, node: str) -> int:
        return self._in_flight.get(node, 0)

    async def encode_all(self, items: list[MediaItem], by_ref: bool = True) -> list[Encoded]:
        """All items concurrently (identical bytes encoded once); result ``i`` is ``items[i]``;
        the first failure cancels the rest. ``by_ref``: ask for the header only (an encoder
        that cannot keep the embeddings still answers by value)."""
        unique: dict[tuple[str, str], MediaItem] = {}
        for it in items:
            unique.setdefault((it.modality, it.content_hash), it)
        share = video_share(self.max_request_video_pixels, sum(it.modality == "video" for it in unique.values()))
        done = await gather_or_cancel(*(self.encode(it, by_ref, share) for it in unique.values()))
        by_key = {(e.item.modality, e.item.content_hash): e for e in done}
        return [replace(by_key[(it.modality, it.content_hash)], item=it) for it in items]

    async def encode(self, item: MediaItem, by_ref: bool = True, video_pixels: int | None = None) -> Encoded:
        """``video_pixels``: this video's share of its request's decoded-pixel budget, if any."""
        nodes = self._ring.bounded_candidates(item.content_hash, self.load, self.attempts, self.load_factor)
        if not nodes:
            raise UpstreamError("no encoder replica is configured", status=503)
        errors: list[str] = []
        i, dropped = 0, 0
        while i < len(nodes):
            node = nodes[i]
            if errors:
                await backoff(len(errors))
            try:
                return await self._encode_on(node, item, by_ref, video_pixels)
            except _Retry as e:
                self._on_failover()
                errors.append(f"{node}: {e}")
                log.warning("encode of %s failed on %s: %s", item.where, node, e)
                if e.dropped and dropped < DROPPED_RETRIES:
                    dropped += 1  # the same node again, on another connection
                else:
                    i += 1
        raise UpstreamError(
            f"{item.where}: encoding the {item.modality} failed on {len(nodes)} encoder "
            f"replica(s): {'; '.join(errors)}"
        )

    async def _encode_on(self, node: str, item: MediaItem, by_ref: bool, video_pixels: int | None = None) -> Encoded:
        self._in_flight[node] = self._in_flight.get(node, 0) + 1
        try:
            return await self._encode_once(node, item, by_ref, video_pixels)
        finally:
            self._in_flight[node] -= 1
            if not self._in_flight[node]:
                del self._in_flight[node]

    async def _encode_once(self, node: str, item: MediaItem, by_ref: bool, video_pixels: int | None = None) -> Encoded:
        params = {"modality": item.modality, "content_hash": item.content_hash}
        if by_ref:
            params["by_ref"] = "true"
        share = {VIDEO_PIXEL_SHARE_HEADER: str(video_pixels)} if video_pixels and item.modality == "video" else {}
        try:
            with self.waits.waiting(node):
                r = await self._client.post(
                    f"{node}/v1/encode",
                    params=params,
                    content=item.data,
                    headers={"content-type": "application/octet-stream", **deadline_header(upstream_deadline.get()),
                             **share},
                    timeout=self.timeout,
                )
        except ReplicaLost as e:  # encoding is idempotent: the next node along the ring
            raise _Retry(str(e)) from e
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            self._pool.report_failure(node)
            raise _Retry(f"connection failed: {type(e).__name__}: {e}") from e
        except _CONNECTION_ERRORS as e:
            raise _dropped(e) from e
        except httpx.TimeoutException as e:
            raise UpstreamError(f"{item.where}: encoding the {item.modality} timed out on {node}", status=504) from e
        if r.status_code == 429:
            raise overloaded(r, "encoder")
        if 400 <= r.status_code < 500:
            raise MediaError(item.where, f"{item.modality} could not be decoded: {error_text(r)}")
        if r.status_code == 503:
            raise _Retry(f"HTTP 503: {error_text(r)}")
        if r.status_code == 504:
            raise UpstreamError(f"{item.where}: encoding the {item.modality} timed out: {error_text(r)}", status=504)
        if r.status_code != 200:
            raise UpstreamError(f"{item.where}: encoding the {item.modality} failed: {error_text(r)}")
        if r.headers.get("content-type", "").startswith("application/json"):
            return self._by_ref(node, item, r)
        try:
            tensors, result = unpack_raw(r.content, EncodeResult)
        except RawWireError as e:
            raise _Retry(f"bad response: {e}") from e
        embeds = tensors.get("embeds")
        if embeds is None or len(embeds.shape) != 2 or embeds.shape[0] != result.num_tokens or embeds.shape[0] < 1:
            shape = None if embeds is None else embeds.shape
            raise _Retry(f"bad response: embeds {shape} vs num_tokens={result.num_tokens}")
        return Encoded(item, result, node, embeds=embeds)

    def _by_ref(self, node: str, item: MediaItem, r: httpx.Response) -> Encoded:
        """A header-only answer: the embeddings stay on ``node`` (and any encoder sharing its
        cache tiers) under ``result.key``."""
        try:
            result = EncodeResult.model_validate_json(r.content)
        except ValueError as e:
            raise _Retry(f"bad response: {e}") from e
        if not result.by_ref or not result.key:
            raise _Retry("bad response: a JSON encode answer without by_ref and key")
        others = [n for n in self._pool.routable() if n != node]
        return Encoded(item, result, node, sources=(node, *others[: MAX_SOURCES - 1]))


class LLMStream:
    """An open NDJSON generation stream; iterate ``batches()``, always ``aclose()``."""

    def __init__(self, response: httpx.Response, replica: str, router: LLMRouter, waits: InFlightWaits) -> None:
        self.response = response
        self.replica = replica
        self._router = router
        self._waits = waits
        self._closed = False
        self._reads: AsyncIterator[bytes] | None = None
        self._finished = False  # the final chunk (one with a finish reason) came

    async def batches(self) -> AsyncIterator[list[GenerateChunk]]:
        """The chunks of each network read together (several when the LLM wrote them faster
        than they were read), so that they go on in one write."""
        reads = self._reads = self.response.aiter_bytes()
        rest = b""
        try:
            while True:
                # one await at a time: a cancel scope never spans the yield
                with self._waits.waiting(self.replica, answering=True):
                    try:
                        data = await anext(reads)
                    except StopAsyncIteration:
                        break
                *lines, rest = (rest + data).split(b"\n")
                batch, bad = [], None
                for x in lines:
                    if x.strip():
                        try:
                            batch.append(GenerateChunk.model_validate_json(x))
                        except ValueError as e:
                            bad = e  # the good lines before it still go out
                            break
                if batch:
                    if batch[-1].finish_reason is not None:
                        self._finished = True
                    yield batch
                if bad is not None:
                    raise bad
            if rest.strip():
                yield [GenerateChunk.model_validate_json(rest)]
        except ReplicaLost as e:
            raise UpstreamError(LOST_MID_GENERATION) from e
        except httpx.HTTPError as e:
            raise UpstreamError(f"LLM stream from {self.replica} broke: {type(e).__name__}: {e}") from e
        except ValueError as e:
            raise UpstreamError(f"LLM stream from {self.replica} sent a bad chunk: {e}") from e

    async def aclose(self) -> None:
        """Closes the upstream connection (the LLM aborts the generation); safe to call twice,
        and completes even inside a cancelled scope."""
        if self._closed:
            return
        self._closed = True
        self._router.end(self.replica)
        with anyio.CancelScope(shield=True):
            if self._finished and self._reads is not None:
                await self._drain(self._reads)
            await self.response.aclose()

    async def _drain(self, reads: AsyncIterator[bytes]) -> None:
        """Reads a finished generation's body to its end (what follows the final chunk: the
        chunked encoding's terminator, already on its way), so that its connection goes back to
        the pool instead of being closed; a new connection per request costs both processes
        far more CPU than this read."""
        with anyio.move_on_after(DRAIN_S):
            try:
                async for _ in reads:
                    pass
            except httpx.HTTPError:
                pass


class LLMClient:
    """Sends a packed GenerateRequest to a replica chosen by the router, failing over on
    connection errors and 5xx."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        pool: ReplicaPool,
        router: LLMRouter,
        *,
        attempts: int,
        timeout: httpx.Timeout,
        limits: ReplicaLimits | None = None,
        pairing: PrefillPairing | None = None,
    ) -> None:
        self._client = client
        self.pairing = pairing  # prefill replicas (role prefill), when configured: docs/disagg.md
        self._pool = pool
        self.router = router
        self.attempts = attempts
        self.timeout = timeout
        self.limits = limits or ReplicaLimits()
        self.waits = InFlightWaits()
        pool.on_lost(self.waits.lose)

    async def generate(self, req: GenerateRequest, body: bytes, prefer: str | None = None) -> GenerateResponse:
        return await self.read(await self._send(req, body, prefer))

    async def read(self, stream: "LLMStream") -> GenerateResponse:
        """The whole (non-streamed) answer of an open generation; closes it."""
        try:
            with self.waits.waiting(stream.replica, answering=True):
                await stream.response.aread()
            try:
                return GenerateResponse.model_validate_json(stream.response.content)
            except ValueError as e:
                raise UpstreamError(f"LLM {stream.replica} sent a bad response: {e}") from e
        except ReplicaLost as e:
            raise UpstreamError(LOST_MID_GENERATION) from e
        except httpx.HTTPError as e:
            raise UpstreamError(f"LLM {stream.replica} failed: {type(e).__name__}: {e}") from e
        finally:
            await stream.aclose()

    async def post_json(self, path: str, payload: dict) -> tuple[int, dict]:
        """``POST path`` with a JSON body to a routable replica (the next on a connection error):
        (status, JSON body). For the small model-info calls (``/tokenize``), not generations."""
        replicas = self._pool.routable()
        if not replicas:
            raise UpstreamError("no LLM replica is configured", status=503)
        errors = []
        for replica in replicas[: max(1, self.attempts)]:
            try:
                r = await self._client.post(f"{replica}{path}", json=payload, timeout=self.timeout)
            except httpx.HTTPError as e:
                if isinstance(e, httpx.ConnectError):
                    self._pool.report_failure(replica)
                errors.append(f"{replica}: {type(e).__name__}")
                continue
            try:
                return r.status_code, r.json()
            except ValueError:
                errors.append(f"{replica}: HTTP {r.status_code} without a JSON body")
        raise UpstreamError(f"{path} failed on {len(errors)} LLM replica(s): {'; '.join(errors)}")

    async def open_stream(self, req: GenerateRequest, body: bytes, prefer: str | None = None) -> LLMStream:
        """Response headers received (status 200); the body is not read yet. ``prefer``: the
        replica to try first (the one holding a sibling choice's prefill)."""
        return await self._send(req, body, prefer)

    def _candidates(self, req: GenerateRequest) -> tuple[list[str], list[int], int]:
        replicas = self._pool.routable()
        if not replicas:
            raise UpstreamError("no LLM replica is configured", status=503)
        text = sum(len(p.text.encode("utf-8")) for m in req.messages for p in m.content if isinstance(p, PromptText))
        est = estimate_prompt_tokens(text, sum(p.num_tokens for p in req.media()))
        # the pairing's estimate counts a completions prompt too (text or ids)
        whole = est + estimate_prompt_tokens(len((req.prompt or "").encode("utf-8")), len(req.prompt_ids or ()))
        return self.limits.bucketed(replicas, est), prefix_blocks(req.messages), whole

    def route(self, req: GenerateRequest) -> str:
        """The replica the router picks for ``req`` (sent nothing): where sibling choices go."""
        replicas, blocks, _ = self._candidates(req)
        return self.router.choose(replicas, blocks)

    async def _send(self, req: GenerateRequest, body: bytes, prefer: str | None = None) -> LLMStream:
        replicas, blocks, est = self._candidates(req)
        # what each replica holds of the prompt before this request is routed (choosing records it)
        held = {r: self.router.match_len(r, blocks) for r in replicas} \
            if self.pairing is not None and hasattr(self.router, "match_len") else {}
        tried: list[str] = []
        errors: list[str] = []
        dropped = 0
        while len(tried) < min(self.attempts, len(replicas)):
            if errors:
                await backoff(len(errors))
            if prefer in replicas and not tried:
                replica = prefer
            else:
                replica = self.router.choose([r for r in replicas if r not in tried], blocks)
            tried.append(replica)
            prefill = None
            if self.pairing is not None:
                prefill = self.pairing.choose(req, est, blocks, held.get(replica, 0))
            try:
                if prefill is None:
                    return await self._send_to(replica, body)
                # the decode replica calls the prefill replica before it answers its headers:
                # the prefill replica is busy with it until then
                self.pairing.router.begin(prefill)
                try:
                    return await self._send_to(replica, self.pairing.body(req, body, prefill))
                finally:
                    self.pairing.router.end(prefill)
            except _Retry as e:
                errors.append(f"{replica}: {e}")
                log.warning("generate %s failed on %s: %s", req.request_id, replica, e)
                if e.dropped and dropped < DROPPED_RETRIES:
                    dropped += 1
                    tried.remove(replica)  # it may be chosen again, on another connection
        raise UpstreamError(f"generation failed on {len(set(tried))} LLM replica(s): {'; '.join(errors)}")

    async def _send_to(self, replica: str, body: bytes) -> LLMStream:
        request = self._client.build_request(
            "POST", f"{replica}/v1/generate", content=body,
            headers={"content-type": SAFETENSORS_MIME, **deadline_header(upstream_deadline.get())},
            timeout=self.timeout,
        )
        self.router.begin(replica)
        try:
            with self.waits.waiting(replica):
                response = await self._client.send(request, stream=True)
        except ReplicaLost as e:  # nothing answered yet: safe on another replica
            self.router.end(replica)
            raise _Retry(str(e)) from e
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            self.router.end(replica)
            self._pool.report_failure(replica)
            raise _Retry(f"connection failed: {type(e).__name__}: {e}") from e
        except _CONNECTION_ERRORS as e:
            self.router.end(replica)
            raise _dropped(e) from e
        except httpx.TimeoutException as e:
            self.router.end(replica)
            raise UpstreamError(f"LLM {replica} timed out", status=504) from e
        except BaseException:
            self.router.end(replica)
            raise
        stream = LLMStream(response, replica, self.router, self.waits)
        if response.status_code == 200:
            return stream
        try:
            await response.aread()
        except httpx.HTTPError:
            pass
        finally:
            await stream.aclose()
        if response.status_code == 429:
            raise overloaded(response, "LLM")
        if response.status_code == 413:
            raise APIError(413, error_text(response), code="request_too_large")
        if response.status_code == 409 and error_code(response) == MEDIA_UNAVAILABLE:
            raise MediaUnavailable(f"LLM {replica}: {error_text(response)}")
        if 400 <= response.status_code < 500:
            raise APIError(400, error_text(response), code="invalid_request")
        if response.status_code == 503:
            raise _Retry(f"HTTP 503: {error_text(response)}")
        status = 504 if response.status_code == 504 else 502
        raise UpstreamError(f"generation failed on {replica}: HTTP {response.status_code}: {error_text(response)}", status)
