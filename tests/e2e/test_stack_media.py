"""The official ``openai`` client against a local stack (1 encoder, 1 ``swa`` LLM, API key and an
SSRF allow-list of 127.0.0.1): real image, H.264 video and WAV audio, plain and streamed; bad
input of every kind answered with a clear 4xx while the stack stays healthy."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable

import httpx
import openai
import pytest

from benchmarks._stack_util import (
    audio_part,
    data_url,
    image_part,
    make_mp4,
    make_png,
    make_wav,
    scrape,
    total,
    user,
    video_part,
)
from mmserve.launcher import LocalStack, StackSpec, free_port
from tests.e2e.conftest import stream_chat

pytestmark = pytest.mark.e2e

KEY = "sk-test-stack-media"
MAX_ITEMS = 4
MAX_MEDIA_BYTES = 256 * 1024


@pytest.fixture(scope="module")
def stack(mimo_bundle, tmp_path_factory):
    spec = StackSpec(
        model_dir=str(mimo_bundle),
        gateway_port=0,
        llm_backend="swa",
        api_keys=(KEY,),
        allowed_hosts=("127.0.0.1",),
        gateway_env={"max_media_items": str(MAX_ITEMS), "max_media_bytes": str(MAX_MEDIA_BYTES)},
    )
    with LocalStack(spec, log_dir=tmp_path_factory.mktemp("stack-media-logs")) as s:
        s.wait_ready(timeout=240)
        yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=KEY, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def media_server():
    """A real HTTP server on 0.0.0.0 serving one PNG at /img.png: reachable as 127.0.0.1
    (allow-listed) and as 127.0.0.2 (loopback, not allow-listed)."""
    png = make_png(seed=11)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            if self.path != "/img.png":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(png)))
            self.end_headers()
            self.wfile.write(png)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("0.0.0.0", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


MEDIA: dict[str, Callable[[], dict]] = {
    "image": lambda: image_part(make_png(seed=5)),
    "video": lambda: video_part(make_mp4(seconds=2.0, seed=5)),
    "audio": lambda: audio_part(make_wav(seconds=1.5, freq=330.0)),
}


@pytest.mark.parametrize("modality", list(MEDIA))
def test_chat_with_media_plain_and_streaming_agree(client, stack, modality):
    part = MEDIA[modality]()
    enc, llm = stack.encoders[0].url, stack.llms[0].url
    before = total(scrape(enc), "encoder_requests_total", modality=modality, status="200")
    refs0 = {o: total(scrape(llm), "mmserve_llm_media_refs_total", outcome=o) for o in ("fetched", "missed")}
    text_only = client.chat.completions.create(
        model=stack.model_name, messages=[user(f"What is in this {modality}?")], max_tokens=1, temperature=0
    )
    msgs = [user(f"What is in this {modality}?", part)]
    plain = client.chat.completions.create(model=stack.model_name, messages=msgs, max_tokens=10, temperature=0)
    choice = plain.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert plain.usage.completion_tokens >= 1
    assert choice.message.content  # so that the streamed == plain comparison below means something
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens
    # the media's placeholder tokens are part of the prompt
    assert plain.usage.prompt_tokens > text_only.usage.prompt_tokens
    # the item went through the encoder as this modality
    after = total(scrape(enc), "encoder_requests_total", modality=modality, status="200")
    assert after == before + 1
    # sent by reference and fetched by the LLM from the encoder `mmserve up` allows (no 409 + re-send)
    refs1 = {o: total(scrape(llm), "mmserve_llm_media_refs_total", outcome=o) for o in ("fetched", "missed")}
    assert refs1 == {"fetched": refs0["fetched"] + 1, "missed": refs0["missed"]}

    text, finish, usage = stream_chat(client, stack.model_name, msgs, 10)
    assert text == choice.message.content
    assert finish == choice.finish_reason
    assert usage is not None
    assert usage.prompt_tokens == plain.usage.prompt_tokens
    assert usage.completion_tokens == plain.usage.completion_tokens


def test_image_from_an_allow_listed_http_url(client, stack, media_server):
    """The positive control for the SSRF cases below: the same server, reached through the
    allow-listed 127.0.0.1, is fetched and answered."""
    url = f"http://127.0.0.1:{media_server}/img.png"
    msgs = [user("Describe.", {"type": "image_url", "image_url": {"url": url}})]
    r = client.chat.completions.create(model=stack.model_name, messages=msgs, max_tokens=4, temperature=0)
    assert r.usage.completion_tokens >= 1
    inline = client.chat.completions.create(
        model=stack.model_name, messages=[user("Describe.", image_part(make_png(seed=11)))], max_tokens=4, temperature=0
    )
    assert r.choices[0].message.content == inline.choices[0].message.content


def _url_image(url: str) -> list[dict]:
    return [user("Describe.", {"type": "image_url", "image_url": {"url": url}})]


def _closed_port() -> int:
    return free_port()  # bound and released: nothing listens there


BAD_INPUT: dict[str, tuple[Callable[[int], list[dict]], int, tuple[str, ...]]] = {
    # name: (messages given the media server's port, status, substrings of the error message)
    "unreachable_url": (
        lambda port: _url_image(f"http://127.0.0.1:{_closed_port()}/img.png"),
        400, ("messages[0].content[1]", "could not fetch"),
    ),
    "unresolvable_host": (
        lambda port: _url_image("http://no-such-host.invalid/img.png"),
        400, ("messages[0].content[1]", "cannot resolve"),
    ),
    "private_ip_reachable_but_not_allow_listed": (
        lambda port: _url_image(f"http://127.0.0.2:{port}/img.png"),
        400, ("messages[0].content[1]", "non-public address"),
    ),
    "private_ip_10_net": (
        lambda port: _url_image("http://10.0.0.1/img.png"),
        400, ("messages[0].content[1]", "non-public address"),
    ),
    "link_local_metadata_ip": (
        lambda port: _url_image("http://169.254.169.254/latest/meta-data/"),
        400, ("non-public address",),
    ),
    "oversized_data_url": (
        lambda port: [user("Describe.", {"type": "image_url", "image_url": {
            "url": data_url("image/png", make_png(seed=1) + b"\0" * (MAX_MEDIA_BYTES + 1))}})],
        400, ("messages[0].content[1]", f"exceeds {MAX_MEDIA_BYTES} bytes"),
    ),
    "truncated_png": (
        lambda port: [user("Describe.", image_part(make_png(seed=2)[:60]))],
        400, ("messages[0].content[1]", "image"),
    ),
    "corrupt_video": (
        lambda port: [user("Describe.", video_part(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8))],
        400, ("messages[0].content[1]", "video"),
    ),
    "corrupt_audio": (
        lambda port: [user("Listen.", audio_part(b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(range(200))))],
        400, ("messages[0].content[1]", "audio"),
    ),
    "image_bytes_in_a_video_part": (
        lambda port: [user("Describe.", {"type": "video_url", "video_url": {
            "url": data_url("image/png", make_png(seed=3))}})],
        400, ("messages[0].content[1]", "video"),
    ),
    "too_many_images": (
        lambda port: [user("Compare.", *(image_part(make_png(seed=s)) for s in range(MAX_ITEMS + 1)))],
        400, ("too many media items", f"{MAX_ITEMS + 1} > {MAX_ITEMS}"),
    ),
}


def _assert_healthy(client, stack) -> None:
    assert httpx.get(f"{stack.url}/readyz", timeout=10).status_code == 200
    ok = client.chat.completions.create(
        model=stack.model_name, messages=[user("Describe.", image_part(make_png(seed=9)))], max_tokens=2
    )
    assert ok.usage.completion_tokens >= 1


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_a_clear_4xx_and_the_stack_stays_healthy(client, stack, media_server, case, stream):
    build, status, needles = BAD_INPUT[case]
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(
            model=stack.model_name, messages=build(media_server), max_tokens=4, stream=stream
        )
    assert e.value.status_code == status, e.value
    body = e.value.body
    assert isinstance(body, dict) and body.get("message"), body  # OpenAI error format
    for needle in needles:
        assert needle.lower() in body["message"].lower(), body["message"]
    _assert_healthy(client, stack)


@pytest.mark.parametrize("key", ["sk-wrong", None], ids=["wrong_key", "no_key"])
def test_bad_api_key_is_401(stack, client, key):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(
        f"{stack.url}/v1/chat/completions",
        json={"model": stack.model_name, "messages": [user("hi")], "max_tokens": 2},
        headers=headers, timeout=30,
    )  # fmt: skip
    assert r.status_code == 401
    assert "API key" in r.json()["error"]["message"]
    bad = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    _assert_healthy(client, stack)


def test_nothing_is_left_running_after_the_bad_requests(client, stack):
    """No generation and no encoder request is stuck after the refused requests above."""
    _assert_healthy(client, stack)
    llm = scrape(stack.llms[0].url)
    assert total(llm, "mmserve_llm_running_requests") == 0
    assert total(llm, "mmserve_llm_waiting_requests") == 0
    gw = scrape(stack.url)
    assert total(gw, "mmserve_gateway_in_flight_requests") == 1  # this scrape itself
