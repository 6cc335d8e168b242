"""Limits with names (issue 42, item 3, the gateway's share), over real HTTP against the fake
encoder / LLM: prompts x n per completions batch, tools per request, schema size. Each refusal
is a 400 naming the setting, sent before anything goes upstream; a 10,000-prompt batch, sent
over and over, is refused at once while the gateway keeps answering everyone else."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from gateway.app import create_app
from mmserve.testing.fake_services import ServerThread
from shared.settings import GatewaySettings

pytestmark = pytest.mark.integration

MODEL = "tiny-test"


@pytest.fixture(scope="module")
def gw(upstreams):
    enc, llm = upstreams
    s = GatewaySettings(model_name=MODEL, encoder_urls=[enc.url], llm_urls=[llm.url], dns_interval=0,
                        health_interval=0, connect_timeout=2)
    server = ServerThread(create_app(s)).start()
    yield server
    server.stop()


def sent(llm) -> int:
    return len(llm.server.config.app.state.requests)


def refused(r: httpx.Response, setting: str, code: str) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["type"] == "invalid_request_error"
    assert f"{setting} (MMSERVE_GATEWAY_{setting.upper()})" in err["message"], err["message"]
    return err


def completion(prompt, **kw) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 2, **kw}


def big_schema(nbytes: int) -> dict:
    props = {f"field_{i}": {"type": "string"} for i in range(nbytes // 20)}
    return {"type": "object", "properties": props}


def tool(i: int, parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": f"tool_{i}", "parameters": parameters or {"type": "object"}}}


def chat(**kw) -> dict:
    return {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], **kw}


def test_10k_prompts_are_refused_at_once_naming_the_setting(gw, upstreams):
    _, llm = upstreams
    n = sent(llm)
    r = httpx.post(gw.url + "/v1/completions", json=completion([f"prompt {i}" for i in range(10_000)]), timeout=30)
    err = refused(r, "max_completion_prompts", "too_many_prompts")
    assert err["param"] == "prompt" and "10000" in err["message"] and "64" in err["message"]
    assert sent(llm) == n  # not one prompt went upstream


def test_prompts_times_n_counts(gw, upstreams):
    _, llm = upstreams
    n = sent(llm)
    with httpx.Client(base_url=gw.url, timeout=60) as c:
        refused(c.post("/v1/completions", json=completion([f"p{i}" for i in range(33)], n=2)),
                "max_completion_prompts", "too_many_prompts")
        assert sent(llm) == n
        r = c.post("/v1/completions", json=completion([f"p{i}" for i in range(32)], n=2))  # 64: the limit
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 64 and sent(llm) == n + 64


def test_the_gateway_keeps_answering_while_10k_prompt_batches_pour_in(gw, upstreams):
    _, llm = upstreams
    n = sent(llm)
    attack = completion([f"prompt number {i}" for i in range(10_000)])
    stop = threading.Event()
    codes: list[int] = []

    def attacker() -> None:
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            while not stop.is_set():
                codes.append(c.post("/v1/completions", json=attack).status_code)

    threads = [threading.Thread(target=attacker) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        with httpx.Client(base_url=gw.url, timeout=5) as c:  # a generous bound: today's batch held it for minutes
            start = time.monotonic()
            while (time.monotonic() - start < 3 or len(codes) < 8) and time.monotonic() - start < 60:
                assert c.get("/healthz").status_code == 200
                r = c.post("/v1/completions", json=completion("an ordinary prompt"))
                assert r.status_code == 200, r.text
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert len(codes) >= 8 and set(codes) == {400}  # every attack refused, and refused fast
    assert sent(llm) - n < 100  # only the ordinary prompts went upstream


def test_tools_past_the_limit_are_refused(gw, upstreams):
    _, llm = upstreams
    n = sent(llm)
    with httpx.Client(base_url=gw.url, timeout=60) as c:
        err = refused(c.post("/v1/chat/completions", json=chat(tools=[tool(i) for i in range(129)])),
                      "max_tools", "too_many_tools")
        assert err["param"] == "tools" and "129" in err["message"]
        responses = {"model": MODEL, "input": "hi", "max_output_tokens": 2,
                     "tools": [{"type": "function", "name": f"t{i}", "parameters": {"type": "object"}}
                               for i in range(129)]}
        refused(c.post("/v1/responses", json=responses), "max_tools", "too_many_tools")
        tokenize = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                    "tools": [tool(i) for i in range(129)]}
        refused(c.post("/tokenize", json=tokenize), "max_tools", "too_many_tools")
        assert sent(llm) == n
        assert c.post("/v1/chat/completions", json=chat(tools=[tool(i) for i in range(128)])).status_code == 200


def test_a_tool_schema_over_the_limit_is_refused(gw, upstreams):
    _, llm = upstreams
    n = sent(llm)
    with httpx.Client(base_url=gw.url, timeout=60) as c:
        tools = [tool(0), tool(1, big_schema(80 * 1024))]
        err = refused(c.post("/v1/chat/completions", json=chat(tools=tools)), "max_schema_bytes", "schema_too_large")
        assert err["param"] == "tools[1].function.parameters" and "tool_1" in err["message"]
        responses = {"model": MODEL, "input": "hi", "max_output_tokens": 2,
                     "tools": [{"type": "function", "name": "t", "parameters": big_schema(80 * 1024)}]}
        refused(c.post("/v1/responses", json=responses), "max_schema_bytes", "schema_too_large")
        assert sent(llm) == n
        ok = [tool(0), tool(1, big_schema(32 * 1024))]
        assert c.post("/v1/chat/completions", json=chat(tools=ok)).status_code == 200


def test_an_output_schema_over_the_limit_is_refused_on_every_path(gw, upstreams):
    _, llm = upstreams
    n = sent(llm)
    fmt = {"type": "json_schema", "json_schema": {"name": "big", "schema": big_schema(80 * 1024)}}
    with httpx.Client(base_url=gw.url, timeout=60) as c:
        err = refused(c.post("/v1/chat/completions", json=chat(response_format=fmt)), "max_schema_bytes",
                      "schema_too_large")
        assert err["param"] == "response_format"
        err = refused(c.post("/v1/chat/completions", json=chat(structured_outputs={"json": big_schema(80 * 1024)})),
                      "max_schema_bytes", "schema_too_large")
        assert err["param"] == "structured_outputs"
        refused(c.post("/v1/completions", json=completion("hi", response_format=fmt)), "max_schema_bytes",
                "schema_too_large")
        text_format = {"format": {"type": "json_schema", "name": "big", "schema": big_schema(80 * 1024)}}
        err = refused(c.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 2,
                                                     "text": text_format}), "max_schema_bytes", "schema_too_large")
        assert err["param"] == "text.format"
        assert sent(llm) == n
        small = {"type": "json_schema", "json_schema": {"name": "small", "schema": big_schema(1024)}}
        assert c.post("/v1/chat/completions", json=chat(response_format=small)).status_code == 200
