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


def test_logprobs_and_top_logprobs_plain_and_streamed(client, stack):
    """``logprobs`` / ``top_logprobs`` come back in OpenAI's shape: one entry per generated token,
    its text the piece of the answer, the chosen token's logprob the best of its alternatives
    (greedy), streamed entries equal to the plain ones."""
    msgs = [{"role": "user", "content": "Say something."}]
    r = client.chat.completions.create(model=stack.model_name, messages=msgs, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens == 8
    assert "".join(e.token for e in lp) == r.choices[0].message.content
    for e in lp:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0.0
        assert abs(e.logprob - e.top_logprobs[0].logprob) < 1e-5  # greedy took the most likely token
        assert [a.logprob for a in e.top_logprobs] == sorted((a.logprob for a in e.top_logprobs), reverse=True)
        assert e.bytes == list(e.token.encode("utf-8"))
    streamed = []
    for chunk in client.chat.completions.create(model=stack.model_name, messages=msgs, max_tokens=8, temperature=0,
                                                logprobs=True, top_logprobs=3, stream=True,
                                                extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            if c.logprobs and c.logprobs.content:
                streamed.extend(c.logprobs.content)
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in lp]
    plain = client.chat.completions.create(model=stack.model_name, messages=msgs, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_penalties_and_logit_bias_change_the_greedy_answer(client, stack):
    """Each knob reaches the sampler: a -100 bias on every token of the plain greedy answer, and
    a strong frequency penalty, each give a different answer (a dropped knob would not)."""
    msgs = [{"role": "user", "content": "Repeat after me: la la la la la."}]
    kw = dict(model=stack.model_name, messages=msgs, max_tokens=16, temperature=0, logprobs=True)
    base = client.chat.completions.create(**kw, extra_body={"ignore_eos": True})
    ids = {e.token for e in base.choices[0].logprobs.content}
    tok = httpx.post(f"{stack.url}/tokenize", json={"model": stack.model_name, "prompt": "".join(ids)}, timeout=30)
    bias_ids = tok.json()["tokens"] if tok.status_code == 200 else []
    answers = {base.choices[0].message.content}
    for extra in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 2.0}):
        r = client.chat.completions.create(**kw, extra_body={"ignore_eos": True, **extra})
        answers.add(r.choices[0].message.content)
    assert len(answers) >= 2
    if bias_ids:
        r = client.chat.completions.create(**kw, logit_bias={str(t): -100 for t in bias_ids},
                                           extra_body={"ignore_eos": True})
        assert r.choices[0].message.content != base.choices[0].message.content


@pytest.mark.parametrize("field,value", [
    ("functions", [{"name": "f", "parameters": {"type": "object"}}]),  # OpenAI's deprecated form
    ("tool_choice", "required"),
    ("frobnicate", 1),
    ("store", True),
])
def test_a_field_that_would_be_dropped_is_a_400_naming_it(stack, field, value):
    body = {"model": stack.model_name, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, field: value}
    r = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


def test_fields_that_change_nothing_are_accepted(client, stack):
    r = client.chat.completions.create(model=stack.model_name, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       user="u1", metadata={"k": "v"}, store=False, tool_choice="none",
                                       response_format={"type": "text"}, service_tier="auto")
    assert r.choices[0].finish_reason in ("stop", "length")


def test_logit_bias_outside_the_vocabulary_is_a_400(stack):
    body = {"model": stack.model_name, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
            "logit_bias": {"99999999": 5}}
    r = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and "logit_bias" in r.json()["error"]["message"]
