"""A request's own Jinja chat template is never rendered unless the operator trusts request
templates (``trust_request_chat_template``, vLLM's ``--trust-request-chat-template``), on every
path that renders one: the LLM service's ``/tokenize`` and ``/v1/generate`` and the gateway's
chat, Responses and ``/tokenize``. When trusted, rendering runs off the event loop."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from transformers import AutoTokenizer

from gateway.app import create_app as gateway_app
from mmserve.testing.fake_services import ServerThread, fake_encoder_app, fake_llm_app
from shared.schemas import GenerateRequest, PromptMessage, PromptText
from shared.settings import GatewaySettings
from tests.integration.test_llm_service import post, start_service

pytestmark = pytest.mark.integration

# a nested loop: 10^10 iterations (the sandbox's largest range is 100,000), hours of one CPU
NESTED = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
# about a second or more of rendering: long enough for /healthz to be asked while it runs
SLOW = "{% for a in range(6000) %}{% for b in range(6000) %}{% endfor %}{% endfor %}done"
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def llm(mimo_bundle):
    with start_service(mimo_bundle, "swa") as s:
        yield s


@pytest.fixture(scope="module")
def trusting_llm(mimo_bundle):
    with start_service(mimo_bundle, "swa", trust_request_chat_template=True) as s:
        yield s


def _healthz_while(url: str, fn) -> tuple[object, list[int]]:
    """``fn()`` on a thread while /healthz is polled: its result and every /healthz status."""
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()))
    t.start()
    codes = []
    with httpx.Client(timeout=5) as c:  # a front whose loop is held would time out here
        while t.is_alive():
            codes.append(c.get(url + "/healthz").status_code)
            time.sleep(0.05)
    t.join()
    return out["r"], codes


def test_tokenize_refuses_a_request_template_and_says_how_to_allow_it(llm):
    body = {"messages": MSGS, "chat_template_kwargs": {"chat_template": NESTED}}
    r, codes = _healthz_while(llm.url, lambda: httpx.post(llm.url + "/tokenize", json=body, timeout=30))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "chat_template_kwargs" and "--trust-request-chat-template" in err["message"]
    assert all(c == 200 for c in codes)
    ok = httpx.post(llm.url + "/tokenize", json={"messages": MSGS}, timeout=30)  # the replica still serves
    assert ok.status_code == 200 and ok.json()["count"] > 0


def test_generate_refuses_a_request_template(llm):
    req = GenerateRequest(request_id="tpl", messages=[PromptMessage(role="user", content=[PromptText(text="hi")])],
                          chat_template_kwargs={"chat_template": NESTED})
    r = post(llm, req, {})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "chat_template_kwargs"


@pytest.mark.parametrize("key", ["tokenize", "messages", "return_dict", "tokenizer_kwargs", "continue_final_message"])
def test_arguments_the_server_sets_are_refused(llm, key):
    r = httpx.post(llm.url + "/tokenize", json={"messages": MSGS, "chat_template_kwargs": {key: True}}, timeout=30)
    assert r.status_code == 400 and key in r.json()["error"]["message"]


def test_a_trusted_request_template_renders_off_the_event_loop(trusting_llm, mimo_bundle):
    tok = AutoTokenizer.from_pretrained(mimo_bundle)
    r = httpx.post(trusting_llm.url + "/tokenize", timeout=30,
                   json={"messages": MSGS, "chat_template_kwargs": {"chat_template": "hello {{ messages|length }}"}})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == tok("hello 1", add_special_tokens=False)["input_ids"]
    body = {"messages": MSGS, "chat_template_kwargs": {"chat_template": SLOW}}
    r, codes = _healthz_while(trusting_llm.url, lambda: httpx.post(trusting_llm.url + "/tokenize", json=body,
                                                                   timeout=120))
    assert r.status_code == 200 and r.json()["tokens"] == tok("done", add_special_tokens=False)["input_ids"]
    assert len(codes) >= 2 and all(c == 200 for c in codes)  # answered while the template rendered


def test_tokenize_refuses_a_text_that_cannot_fit_before_rendering_it(llm):
    big = "word " * 20000  # max_model_len is 512
    for body in ({"prompt": big}, {"messages": [{"role": "user", "content": big}]}):
        r = httpx.post(llm.url + "/tokenize", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text


@pytest.fixture(scope="module")
def gateway():
    enc = ServerThread(fake_encoder_app("e0")).start()
    llm = ServerThread(fake_llm_app("l0")).start()
    gw = ServerThread(gateway_app(GatewaySettings(model_name="m", encoder_urls=[enc.url], llm_urls=[llm.url],
                                                  dns_interval=0, health_interval=0))).start()
    yield gw, llm
    for s in (gw, llm, enc):
        s.stop()


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"model": "m", "messages": MSGS, "chat_template_kwargs": {"chat_template": NESTED}}),
    ("/tokenize", {"model": "m", "messages": MSGS, "chat_template_kwargs": {"chat_template": NESTED}}),
    ("/v1/chat/completions", {"model": "m", "messages": MSGS, "chat_template_kwargs": {"tokenize": True}}),
])
def test_gateway_refuses_request_templates_before_any_upstream_call(gateway, path, body):
    gw, llm = gateway
    seen = len(llm.server.config.app.state.requests)
    r = httpx.post(gw.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "chat_template_kwargs" or "chat_template_kwargs" in r.text
    assert len(llm.server.config.app.state.requests) == seen
