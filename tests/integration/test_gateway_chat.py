"""The gateway over real HTTP on loopback against fake encoder/LLM services with known answers."""

import base64
import io
import json

import httpx
import pytest
from PIL import Image

from gateway.app import create_app
from mmserve.testing.fake_services import ServerThread, fake_encoder_app, fake_llm_app
from shared.hashing import content_hash
from shared.settings import GatewaySettings

pytestmark = pytest.mark.integration

MODEL = "tiny-test"


def png(color=(255, 0, 0), size=(8, 8)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(data: bytes, mime: str = "image/png") -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data, mime)}}


def chat(*parts, **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": list(parts)}], **kw}


@pytest.fixture(scope="module")
def stack():
    enc = ServerThread(fake_encoder_app("enc")).start()
    llm = ServerThread(fake_llm_app("llm")).start()
    settings = GatewaySettings(
        model_name=MODEL, encoder_urls=[enc.url], llm_urls=[llm.url], max_media_items=4,
        max_media_bytes=4096, health_interval=0, dns_interval=0, default_max_tokens=11,
    )
    gw = ServerThread(create_app(settings)).start()
    client = httpx.Client(base_url=gw.url, timeout=30)
    yield client, enc.server.config.app, llm.server.config.app
    client.close()
    for s in (gw, llm, enc):
        s.stop()


def post(client: httpx.Client, body) -> httpx.Response:
    return client.post("/v1/chat/completions", json=body)


def assert_openai_error(r: httpx.Response, status: int, *fragments: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for f in fragments:
        assert f in err["message"], err["message"]
    return err


def test_image_and_text_reach_the_llm_in_order(stack):
    client, _, _ = stack
    red, blue = png((255, 0, 0)), png((0, 0, 255), size=(16, 16))
    r = post(client, chat({"type": "text", "text": "compare"}, image_part(red), image_part(blue)))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL and body["id"].startswith("chatcmpl-")
    echo = json.loads(body["choices"][0]["message"]["content"])
    parts = echo["messages"][0]["parts"]
    assert parts[0] == {"text": "compare"}
    # the fake encoder fills embeds with len(body) and makes len(body) % 5 + 1 rows
    for part, data, idx in ((parts[1], red, 0), (parts[2], blue, 1)):
        assert part["index"] == idx and part["fill"] == len(data) and part["hash"] == content_hash(data)
        assert part["key"].endswith(f":sig:{content_hash(data)}")  # the encoder's media key, passed on
        assert part["num_tokens"] == part["rows"] == len(data) % 5 + 1
    assert echo["sampling"]["max_tokens"] == 11
    media_tokens = parts[1]["num_tokens"] + parts[2]["num_tokens"]
    assert body["usage"] == {"prompt_tokens": media_tokens + 1, "completion_tokens": 7,
                             "total_tokens": media_tokens + 8, "prompt_tokens_details": {"cached_tokens": 3}}
    assert body["choices"][0]["finish_reason"] == "stop"


def test_audio_and_video_parts(stack):
    client, enc, _ = stack
    audio, video = b"RIFF-not-really-wav", b"\x00\x00\x00\x18ftypmp42-ish"
    r = post(client, chat(
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(audio).decode(), "format": "wav"}},
        {"type": "video_url", "video_url": {"url": data_url(video, "video/mp4")}},
    ))
    assert r.status_code == 200, r.text
    parts = json.loads(r.json()["choices"][0]["message"]["content"])["messages"][0]["parts"]
    assert [(p["media"], p["fill"]) for p in parts] == [("audio", len(audio)), ("video", len(video))]
    assert ("audio", content_hash(audio), len(audio)) in enc.state.calls


def parse_sse(text: str) -> list:
    events = text.split("\n\n")
    assert events[-1] == "", "stream must end with a blank line"
    out = []
    for ev in events[:-1]:
        assert ev.startswith("data: "), ev
        payload = ev[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_streaming_sse_format(stack):
    client, _, _ = stack
    body = chat({"type": "text", "text": "hello"}, image_part(png()), stream=True,
                stream_options={"include_usage": True})
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = parse_sse(text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-2])
    assert json.loads(content)["messages"][0]["parts"][0] == {"text": "hello"}
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and chunks[-2]["choices"][0]["delta"] == {}
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 7
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 3


def test_streaming_without_usage_has_no_usage_chunk(stack):
    client, _, _ = stack
    events = parse_sse(post(client, chat({"type": "text", "text": "x"}, stream=True)).text)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "stop"
    assert all("usage" not in e for e in events[:-1])


def test_mid_stream_failure_becomes_error_event(stack):
    client, _, _ = stack
    events = parse_sse(post(client, chat({"type": "text", "text": "FAIL_MID"}, stream=True)).text)
    assert events[-1] == "[DONE]"
    assert "engine exploded" in events[-2]["error"]["message"]
    assert not any(e != "[DONE]" and e.get("choices") and e["choices"][0]["finish_reason"] for e in events)


def test_malformed_json(stack):
    client, _, _ = stack
    r = client.post("/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert_openai_error(r, 400, "not valid JSON")


def test_unknown_content_part_type(stack):
    client, _, _ = stack
    err = assert_openai_error(post(client, chat({"type": "image_file", "file": "x"})), 400, "'image_file'")
    assert err["param"] == "messages[0].content[0].type" and err["type"] == "invalid_request_error"
    # a type that is not a string is a 400 too, never a 500
    err = assert_openai_error(post(client, chat({"type": {}, "input_audio": {"data": "0", "format": "wav"}})), 400,
                              "must be a string")
    assert err["param"] == "messages[0].content[0].type"


def test_unknown_model(stack):
    client, _, _ = stack
    body = {"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]}
    err = assert_openai_error(post(client, body), 404, "gpt-17")
    assert err["code"] == "model_not_found"


def test_n_choices_and_their_bound(stack):
    """n = 2: two choices, one request id each on the same replica; above the bound: 400."""
    client, _, _ = stack
    r = post(client, chat({"type": "text", "text": "x"}, n=2))
    assert r.status_code == 200 and [c["index"] for c in r.json()["choices"]] == [0, 1]
    assert_openai_error(post(client, chat({"type": "text", "text": "x"}, n=17)), 400, "n")


def test_bad_base64(stack):
    client, enc, _ = stack
    calls = len(enc.state.calls)
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%notbase64"}}
    err = assert_openai_error(post(client, chat({"type": "text", "text": "x"}, part)), 400,
                              "messages[0].content[1]", "base64")
    assert err["param"] == "messages[0].content[1]"
    assert len(enc.state.calls) == calls, "bad media must not reach the encoder"


def test_mime_mismatch(stack):
    client, _, _ = stack
    assert_openai_error(post(client, chat(image_part(png(), "audio/wav"))), 400, "does not match")


def test_too_many_images(stack):
    client, _, _ = stack
    assert post(client, chat(*[image_part(png())] * 4)).status_code == 200
    assert_openai_error(post(client, chat(*[image_part(png())] * 5)), 400, "too many media items: 5 > 4")


def test_media_too_large(stack):
    client, _, _ = stack
    big = png(size=(8, 8)) + b"\x00" * 5000
    assert_openai_error(post(client, chat(image_part(big))), 400, "exceeds 4096 bytes")


def test_encoder_4xx_is_relayed_naming_the_item(stack):
    client, _, _ = stack
    r = post(client, chat({"type": "text", "text": "look"}, image_part(b"this is not a png")))
    err = assert_openai_error(r, 400, "messages[0].content[1]: image could not be decoded", "cannot decode image")
    assert err["param"] == "messages[0].content[1]"


def test_llm_4xx_is_relayed(stack):
    client, _, _ = stack
    assert_openai_error(post(client, chat({"type": "text", "text": "TOO_LONG"})), 400, "prompt is too long")
    r = post(client, chat({"type": "text", "text": "TOO_LONG"}, stream=True))
    assert_openai_error(r, 400, "prompt is too long")


def test_models_and_health(stack):
    client, _, _ = stack
    assert client.get("/v1/models").json() == {
        "object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "mmserve"}]}
    assert client.get("/healthz").status_code == 200
    assert client.get("/readyz").status_code == 200
    assert_openai_error(client.get("/v1/nothing"), 404)


def test_metrics(stack):
    client, _, _ = stack
    post(client, chat({"type": "text", "text": "x"}, image_part(png()), stream=True))
    post(client, chat({"type": "image_file"}))
    text = client.get("/metrics").text
    assert 'mmserve_gateway_requests_total{route="/v1/chat/completions",status="200"}' in text
    assert 'mmserve_gateway_requests_total{route="/v1/chat/completions",status="400"}' in text
    assert 'mmserve_gateway_media_items_total{modality="image"}' in text
    assert "mmserve_gateway_ttft_seconds_count" in text and "mmserve_gateway_in_flight_requests" in text
    ttft = next(line for line in text.splitlines() if line.startswith("mmserve_gateway_ttft_seconds_count"))
    assert float(ttft.split()[-1]) >= 1


def test_stream_ending_without_finish_is_an_error_event(stack):
    client, _, _ = stack
    events = parse_sse(post(client, chat({"type": "text", "text": "NO_FINISH"}, stream=True)).text)
    assert events[-1] == "[DONE]" and "without a finish reason" in events[-2]["error"]["message"]
