"""Media items of a chat request: find them, decode ``data:`` URLs and base64, enforce limits.

Items are named by where they sit in the request (``messages[0].content[1]``) so every error
the client sees points at the offending part.  Fetching http(s) URLs lives in ``gateway.media.fetch``.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass, field
from urllib.parse import unquote_to_bytes

from gateway.errors import APIError
from gateway.openai_api.requests import ChatCompletionRequest
from shared.hashing import content_hash
from shared.schemas import AudioPart, ImagePart, Modality, VideoPart

# Declared mime types accepted per modality besides "<modality>/*" (checked loosely: a client
# that says application/octet-stream is trusted, the encoder decides).
_GENERIC_MIMES = {"", "application/octet-stream", "binary/octet-stream"}
_EXTRA_MIMES: dict[str, set[str]] = {
    "image": set(),
    "video": {"image/gif", "application/mp4", "application/x-matroska"},
    "audio": {"video/webm", "video/ogg", "application/ogg"},
}
_WS = re.compile(rb"\s+")


class MediaError(APIError):
    """A media item is unusable; rendered as 400 naming the item."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(400, f"{where}: {message}", param=where, code="invalid_media")
        self.where = where


@dataclass(frozen=True)
class MediaRef:
    """A media part of the request before its bytes are known."""

    modality: Modality
    where: str
    source: str  # a data: or http(s) URL, or raw base64 (input_audio)
    is_base64: bool = False

    @property
    def is_remote(self) -> bool:
        return not self.is_base64 and not self.source.startswith("data:")


@dataclass(frozen=True)
class MediaItem:
    """A media part with its bytes; ``index`` is its position among the request's media."""

    index: int
    modality: Modality
    where: str
    data: bytes = field(repr=False)
    content_hash: str


class ByteBudget:
    """Bytes left for all media of one request; ``charge`` raises once they run out."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def charge(self, n: int, where: str) -> None:
        self.used += n
        if self.used > self.limit:
            raise MediaError(where, f"request media exceed {self.limit} bytes in total")


def collect_media(req: ChatCompletionRequest, max_items: int) -> list[MediaRef]:
    """The request's media parts in prompt order; raises if there are more than ``max_items``."""
    refs: list[MediaRef] = []
    for i, msg in enumerate(req.messages):
        if isinstance(msg.content, str) or msg.content is None:
            continue
        for j, part in enumerate(msg.content):
            where = f"messages[{i}].content[{j}]"
            if isinstance(part, ImagePart):
                refs.append(MediaRef("image", where, part.image_url.url))
            elif isinstance(part, VideoPart):
                refs.append(MediaRef("video", where, part.video_url.url))
            elif isinstance(part, AudioPart):
                data = part.input_audio.data
                refs.append(MediaRef("audio", where, data, is_base64=not data.startswith("data:")))
    if len(refs) > max_items:
        raise APIError(
            400, f"too many media items: {len(refs)} > {max_items} allowed per request",
            param="messages", code="too_many_media_items",
        )
    return refs


def mime_matches(mime: str, modality: str) -> bool:
    mime = mime.lower()
    return mime in _GENERIC_MIMES or mime.startswith(modality + "/") or mime in _EXTRA_MIMES[modality]


def decode_base64(text: str, where: str, max_bytes: int) -> bytes:
    """Strict base64 (whitespace tolerated, urlsafe alphabet accepted) with a size limit checked
    before decoding."""
    raw = _WS.sub(b"", text.encode("ascii", errors="replace"))
    if len(raw) // 4 * 3 > max_bytes + 2:
        raise MediaError(where, f"media exceeds {max_bytes} bytes")
    if b"-" in raw or b"_" in raw:
        raw = raw.replace(b"-", b"+").replace(b"_", b"/")
    raw += b"=" * (-len(raw) % 4)
    try:
        data = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(where, f"invalid base64 data: {e}") from e
    if not data:
        raise MediaError(where, "media is empty")
    if len(data) > max_bytes:
        raise MediaError(where, f"media exceeds {max_bytes} bytes")
    return data


def decode_data_url(url: str, modality: str, where: str, max_bytes: int) -> bytes:
    """Bytes of ``data:[<mime>][;params][;base64],<payload>``; the mime must fit the modality."""
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise MediaError(where, "malformed data URL: missing ','")
    params = [p.strip() for p in header.split(";")]
    mime, is_b64 = params[0], "base64" in (p.lower() for p in params[1:])
    if not mime_matches(mime, modality):
        raise MediaError(where, f"data URL type {mime!r} does not match a {modality} part")
    if is_b64:
        return decode_base64(payload, where, max_bytes)
    data = unquote_to_bytes(payload)
    if not data:
        raise MediaError(where, "media is empty")
    if len(data) > max_bytes:
        raise MediaError(where, f"media exceeds {max_bytes} bytes")
    return data


def decode_inline(ref: MediaRef, max_bytes: int) -> bytes:
    """Bytes of an inline item (``data:`` URL or base64); remote refs are the fetcher's job."""
    if ref.is_base64:
        return decode_base64(ref.source, ref.where, max_bytes)
    if ref.source.startswith("data:"):
        return decode_data_url(ref.source, ref.modality, ref.where, max_bytes)
    raise ValueError(f"{ref.where} is not inline")


def make_item(index: int, ref: MediaRef, data: bytes) -> MediaItem:
    return MediaItem(index, ref.modality, ref.where, data, content_hash(data))
