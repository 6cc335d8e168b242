import base64

import pytest

from gateway.errors import APIError
from gateway.media.items import (
    ByteBudget,
    MediaError,
    MediaRef,
    collect_media,
    decode_base64,
    decode_data_url,
    decode_inline,
    make_item,
    mime_matches,
)
from gateway.openai_api.requests import ChatCompletionRequest
from shared.hashing import content_hash

pytestmark = pytest.mark.unit


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def req(*contents) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": list(c)} for c in contents])


def test_data_url_decodes_base64():
    assert decode_data_url(f"data:image/png;base64,{b64(b'abc123')}", "image", "w", 100) == b"abc123"


def test_data_url_percent_encoded_payload():
    assert decode_data_url("data:image/svg+xml,%3Csvg%3E", "image", "w", 100) == b"<svg>"


def test_data_url_mime_must_fit_modality():
    with pytest.raises(MediaError, match="does not match a image part") as e:
        decode_data_url(f"data:audio/wav;base64,{b64(b'x')}", "image", "messages[0].content[1]", 100)
    assert e.value.status == 400 and e.value.param == "messages[0].content[1]"
    assert e.value.message.startswith("messages[0].content[1]: ")


@pytest.mark.parametrize(
    "mime,modality,ok",
    [("image/jpeg", "image", True), ("", "image", True), ("application/octet-stream", "video", True),
     ("video/mp4", "video", True), ("image/gif", "video", True), ("text/plain", "image", False),
     ("video/mp4", "audio", False), ("audio/mpeg", "audio", True), ("IMAGE/PNG", "image", True)],
)
def test_mime_matches(mime, modality, ok):
    assert mime_matches(mime, modality) is ok


def test_bad_base64_is_a_media_error():
    with pytest.raises(MediaError, match="invalid base64"):
        decode_data_url("data:image/png;base64,@@@not base64@@@", "image", "w", 100)


def test_base64_tolerates_whitespace_urlsafe_and_missing_padding():
    data = bytes(range(256))
    wrapped = "\n".join(b64(data)[i : i + 76] for i in range(0, len(b64(data)), 76))
    assert decode_base64(wrapped, "w", 1000) == data
    urlsafe = base64.urlsafe_b64encode(data).decode().rstrip("=")
    assert decode_base64(urlsafe, "w", 1000) == data


def test_size_limit_checked_before_and_after_decoding():
    with pytest.raises(MediaError, match="exceeds 10 bytes"):
        decode_base64(b64(b"x" * 100), "w", 10)
    with pytest.raises(MediaError, match="exceeds 10 bytes"):
        decode_base64(b64(b"x" * 11), "w", 10)
    assert decode_base64(b64(b"x" * 10), "w", 10) == b"x" * 10


def test_empty_media_refused():
    with pytest.raises(MediaError, match="empty"):
        decode_data_url("data:image/png;base64,", "image", "w", 10)


def test_missing_comma_refused():
    with pytest.raises(MediaError, match="missing ','"):
        decode_data_url("data:image/png;base64", "image", "w", 10)


def test_collect_media_order_and_locations():
    r = req(
        [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "http://x/1.png"}}],
        [{"type": "input_audio", "input_audio": {"data": b64(b"wav"), "format": "wav"}},
         {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}],
    )
    refs = collect_media(r, 16)
    assert [(x.modality, x.where) for x in refs] == [
        ("image", "messages[0].content[1]"), ("audio", "messages[1].content[0]"), ("video", "messages[1].content[1]"),
    ]
    assert refs[0].is_remote and not refs[1].is_remote and not refs[2].is_remote
    assert refs[1].is_base64 and decode_inline(refs[1], 100) == b"wav"


def test_audio_data_may_be_a_data_url():
    r = req([{"type": "input_audio", "input_audio": {"data": f"data:audio/wav;base64,{b64(b'RIFF')}"}}])
    (ref,) = collect_media(r, 16)
    assert not ref.is_base64 and decode_inline(ref, 100) == b"RIFF"


def test_too_many_items():
    parts = [{"type": "image_url", "image_url": {"url": "http://x/a"}}] * 3
    assert len(collect_media(req(parts), 3)) == 3
    with pytest.raises(APIError, match="too many media items: 3 > 2") as e:
        collect_media(req(parts), 2)
    assert e.value.status == 400


def test_string_content_has_no_media():
    r = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hello"}])
    assert collect_media(r, 0) == []


def test_byte_budget():
    b = ByteBudget(10)
    b.charge(6, "a")
    with pytest.raises(MediaError, match="exceed 10 bytes in total") as e:
        b.charge(5, "b")
    assert e.value.where == "b"


def test_make_item_hashes_content():
    item = make_item(2, MediaRef("image", "w", "data:,x"), b"hello")
    assert item.index == 2 and item.content_hash == content_hash(b"hello")
