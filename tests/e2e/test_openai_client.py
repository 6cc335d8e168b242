"""The official ``openai`` client against the local stack: text + a real image, plain and streamed."""

from __future__ import annotations

import base64

import httpx
import openai
import pytest

from tests.conftest import make_png
from tests.e2e.conftest import stream_chat

pytestmark = pytest.mark.e2e


def _image_message(png: bytes, text: str = "Describe this image.") -> list[dict]:
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": text},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", timeout=120, max_retries=0)


def test_models_lists_the_served_model(client, stack):
    ids = [m.id for m in client.models.list().data]
    assert ids == [stack.model_name]


def test_chat_with_image_plain_and_streaming_agree(client, stack):
    msgs = _image_message(make_png(seed=3))
    plain = client.chat.completions.create(model=stack.model_name, messages=msgs, max_tokens=12, temperature=0)
    choice = plain.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert plain.usage.completion_tokens >= 1
    # 16 image placeholder tokens + the text turn
    assert plain.usage.prompt_tokens > 16
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens

    text, finish, usage = stream_chat(client, stack.model_name, msgs, max_tokens=12)
    assert text == choice.message.content
    assert finish == choice.finish_reason
    assert usage is not None and usage.completion_tokens == plain.usage.completion_tokens


def test_different_images_change_the_answer_context(client, stack):
    """The image reaches the model: two different images give different prompt embeddings,
    so over a few images at least two greedy answers differ (random weights still react)."""
    answers = {
        client.chat.completions.create(
            model=stack.model_name, messages=_image_message(make_png(seed=s)), max_tokens=8, temperature=0
        ).choices[0].message.content
        for s in range(4)
    }
    assert len(answers) >= 2


def test_unknown_model_is_a_404_with_openai_error(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert "no-such-model" in str(e.value)


def test_undecodable_image_is_a_400_and_stack_stays_healthy(client, stack):
    msgs = _image_message(b"this is not an image at all")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=stack.model_name, messages=msgs, max_tokens=4)
    assert "image" in str(e.value).lower()
    assert httpx.get(f"{stack.url}/readyz", timeout=5).status_code == 200
    ok = client.chat.completions.create(
        model=stack.model_name, messages=_image_message(make_png(seed=1)), max_tokens=4
    )
    assert ok.choices[0].message.content is not None


def test_malformed_json_is_a_400(stack):
    r = httpx.post(
        f"{stack.url}/v1/chat/completions",
        content=b"{not json",
        headers={"Content-Type": "application/json"},
        timeout=10,
    )
    assert r.status_code == 400
    assert "message" in r.json()["error"]


def test_metrics_are_prometheus_text(stack):
    for svc in stack.services:
        r = httpx.get(f"{svc.url}/metrics", timeout=5)
        assert r.status_code == 200, svc.name
        assert "# TYPE" in r.text, svc.name


def test_ignore_eos_and_min_tokens_hold_the_length_clients_ask_for(client, stack):
    """vLLM's extensions (sent by aiperf / guidellm) pass through the gateway to the engine:
    the streamed and plain answers both report exactly the tokens asked for."""
    msgs = [{"role": "user", "content": "Count to ten."}]
    for extra in ({"ignore_eos": True}, {"min_tokens": 17}):
        r = client.chat.completions.create(model=stack.model_name, messages=msgs, max_tokens=17, extra_body=extra)
        assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 17), extra
        usage, n_chunks = None, 0
        for chunk in client.chat.completions.create(
            model=stack.model_name, messages=msgs, max_tokens=17, extra_body=extra, stream=True,
            stream_options={"include_usage": True},
        ):  # fmt: skip
            usage = chunk.usage or usage
            n_chunks += sum(1 for c in chunk.choices if c.delta.content)
        assert usage.completion_tokens == 17 and 0 < n_chunks <= 17, extra


def test_min_tokens_above_max_tokens_is_a_400_naming_the_field(stack):
    body = {"model": stack.model_name, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
            "min_tokens": 5}
    r = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400
    assert "min_tokens" in r.json()["error"]["message"]


def test_health_answers_for_load_clients(stack):
    r = httpx.get(f"{stack.url}/health", timeout=5)
    assert r.status_code == 200 and r.json()["status"] == "ok"
