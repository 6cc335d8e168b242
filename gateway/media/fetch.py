"""Turning media refs into bytes: inline data decoded, http(s) URLs fetched concurrently with
size, time and redirect limits, every hop checked by the SSRF guard."""

from __future__ import annotations

import asyncio
import zlib
from urllib.parse import urljoin

import httpx

from gateway.aio import gather_or_cancel
from gateway.media.fetch_decode import ACCEPT_ENCODING, BoundedDecoder, DecodedTooLarge, UnsupportedEncoding
from gateway.media.items import ByteBudget, MediaError, MediaItem, MediaRef, decode_inline, make_item
from gateway.media.ssrf import SSRFError, SSRFGuard

_REDIRECTS = (301, 302, 303, 307, 308)


class MediaFetcher:
    """Fetches remote media with one pooled client; redirects are followed by hand so each hop's
    address is checked (and pinned) by the guard."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        guard: SSRFGuard,
        *,
        max_bytes: int,
        timeout: float,
        max_redirects: int,
    ) -> None:
        self._client = client
        self._guard = guard
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.max_redirects = max_redirects

    async def fetch(self, ref: MediaRef, budget: ByteBudget) -> bytes:
        """The body at ``ref.source``; raises ``MediaError`` naming the item on any failure."""
        try:
            async with asyncio.timeout(self.timeout):
                return await self._fetch(ref, budget)
        except TimeoutError:
            raise MediaError(ref.where, f"fetching the {ref.modality} timed out after {self.timeout:g}s") from None
        except SSRFError as e:
            raise MediaError(ref.where, f"URL refused: {e}") from e
        except httpx.HTTPError as e:
            raise MediaError(ref.where, f"could not fetch the {ref.modality}: {type(e).__name__}: {e}") from e

    async def _fetch(self, ref: MediaRef, budget: ByteBudget) -> bytes:
        url = ref.source
        for _ in range(self.max_redirects + 1):
            target = await self._guard.check(url)
            host = target.host if ":" not in target.host else f"[{target.host}]"
            default_port = 443 if target.scheme == "https" else 80
            headers = {"Host": host if target.port == default_port else f"{host}:{target.port}",
                       "Accept-Encoding": ACCEPT_ENCODING}
            ext = {"sni_hostname": target.host} if target.scheme == "https" else {}
            request = self._client.build_request(
                "GET", target.pinned_url(), headers=headers, extensions=ext
            )
            response = await self._client.send(request, stream=True)
            try:
                if response.status_code in _REDIRECTS and "location" in response.headers:
                    url = urljoin(url, response.headers["location"])
                    continue
                if response.status_code != 200:
                    raise MediaError(ref.where, f"fetching the {ref.modality} failed: HTTP {response.status_code}")
                return await self._read(response, ref, budget)
            finally:
                await response.aclose()
        raise MediaError(ref.where, f"too many redirects (more than {self.max_redirects})")

    async def _read(self, response: httpx.Response, ref: MediaRef, budget: ByteBudget) -> bytes:
        """The body with its Content-Encoding undone, counted after decoding: ``max_media_bytes``
        caps the decoded bytes as they are produced (a gzip bomb stops at the cap)."""
        limit = f"max_media_bytes={self.max_bytes}"
        declared = response.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.max_bytes:
            raise MediaError(ref.where, f"media exceeds {self.max_bytes} bytes ({declared} declared; {limit})")
        try:
            decoder = BoundedDecoder(response.headers.get("content-encoding", ""), self.max_bytes)
        except UnsupportedEncoding as e:
            raise MediaError(ref.where, str(e)) from None
        chunks: list[bytes] = []
        async for raw in response.aiter_raw():  # raw: httpx would inflate each chunk whole first
            try:
                chunk = decoder.feed(raw)
            except DecodedTooLarge:
                how = f" after {'+'.join(decoder.encodings)} decoding" if decoder.encodings else ""
                raise MediaError(ref.where, f"media exceeds {self.max_bytes} bytes{how} ({limit})") from None
            except zlib.error as e:
                raise MediaError(ref.where, f"the {'+'.join(decoder.encodings)} body is corrupt: {e}") from None
            budget.charge(len(chunk), ref.where)
            chunks.append(chunk)
        if decoder.size == 0:
            raise MediaError(ref.where, "fetched media is empty")
        return b"".join(chunks)

    async def load(self, refs: list[MediaRef], total_limit: int) -> list[MediaItem]:
        """Bytes of every ref, remote ones fetched concurrently; item ``i`` is ``refs[i]``."""
        budget = ByteBudget(total_limit)

        async def one(i: int, ref: MediaRef) -> MediaItem:
            if ref.is_remote:
                data = await self.fetch(ref, budget)
            else:
                data = decode_inline(ref, self.max_bytes)
                budget.charge(len(data), ref.where)
            return make_item(i, ref, data)

        return list(await gather_or_cancel(*(one(i, r) for i, r in enumerate(refs))))

