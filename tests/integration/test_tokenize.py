"""vLLM's ``/tokenize`` and ``/detokenize`` on the LLM service over real HTTP: the served
tokenizer and chat template (what ``/v1/generate`` renders), round trips, and clear 400s."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from tests.integration.test_llm_service import start_service

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def svc(mimo_bundle):
    with start_service(mimo_bundle, "swa") as s:
        yield s


@pytest.fixture(scope="module")
def tok(mimo_bundle):
    return AutoTokenizer.from_pretrained(mimo_bundle)


def test_prompt_tokenizes_as_the_tokenizer_and_round_trips(svc, tok):
    text = "hello world, how are you?"
    r = httpx.post(svc.url + "/tokenize", json={"prompt": text, "return_token_strs": True}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok(text)["input_ids"] and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 512
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    back = httpx.post(svc.url + "/detokenize", json={"tokens": body["tokens"]}, timeout=30)
    assert back.status_code == 200 and back.json()["prompt"] == tok.decode(body["tokens"])


def test_messages_render_through_the_chat_template(svc, tok):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = httpx.post(svc.url + "/tokenize", json={"messages": msgs}, timeout=30)
    assert r.status_code == 200, r.text
    want = tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    assert r.json()["tokens"] == want["input_ids"]
    no_gen = httpx.post(svc.url + "/tokenize", json={"messages": msgs, "add_generation_prompt": False}, timeout=30)
    assert no_gen.json()["count"] < r.json()["count"]


@pytest.mark.parametrize("body,field", [
    ({"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "bogus": 1}, "bogus"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]}, "text"),
])
def test_bad_tokenize_requests_are_400s_that_say_what_to_fix(svc, body, field):
    r = httpx.post(svc.url + "/tokenize", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


def test_detokenize_refuses_ids_outside_the_vocabulary(svc):
    r = httpx.post(svc.url + "/detokenize", json={"tokens": [1, 10**9]}, timeout=30)
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
