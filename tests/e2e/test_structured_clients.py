"""Structured outputs through the whole stack with the official ``openai`` client: ``parse``
with a pydantic model, ``json_schema`` streamed, vLLM's ``structured_outputs`` (regex, choice),
text completions under a schema, and bad schemas as 400s that name the problem.

The stack runs with compact JSON (``MMSERVE_LLM_STRUCTURED_ANY_WHITESPACE=false``): the tiny
random-weight model, left free to put whitespace between JSON tokens, pads until max_tokens."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from shared.launcher import LocalStack, StackSpec

pytestmark = pytest.mark.e2e


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    indoor: bool
    tags: list[Literal["small", "loud", "old"]] = Field(max_length=3)


@pytest.fixture(scope="module")
def stack(mimo_bundle, tmp_path_factory):
    spec = StackSpec(model_dir=str(mimo_bundle), gateway_port=0, encoders=0,
                     extra_env={"MMSERVE_LLM_STRUCTURED_ANY_WHITESPACE": "false"})
    with LocalStack(spec, log_dir=tmp_path_factory.mktemp("stack-logs")) as s:
        s.wait_ready(timeout=240)
        yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", timeout=120, max_retries=0)


def _msgs(text: str = "Describe a pet as JSON.") -> list[dict]:
    return [{"role": "user", "content": text}]


def test_parse_with_a_pydantic_model(client, stack):
    for seed in range(3):
        r = client.chat.completions.parse(model=stack.model_name, messages=_msgs(), response_format=Pet,
                                          max_tokens=200, temperature=1.0, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(r.choices[0].message.parsed, Pet)


def test_json_schema_streamed_is_the_same_document(client, stack):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "w": {"enum": ["red", "green"]}},
              "required": ["n", "w"], "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    plain = client.chat.completions.create(model=stack.model_name, messages=_msgs(), response_format=rf,
                                           max_tokens=100, temperature=0)
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=stack.model_name, messages=_msgs(), response_format=rf, max_tokens=100, temperature=0, stream=True)
        if c.choices]
    assert "".join(pieces) == plain.choices[0].message.content
    jsonschema.validate(json.loads(plain.choices[0].message.content), schema)


def test_vllm_structured_outputs_regex_and_choice(client, stack):
    r = client.chat.completions.create(model=stack.model_name, messages=_msgs("a code"), max_tokens=40,
                                       extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}})
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", r.choices[0].message.content)
    r = client.chat.completions.create(model=stack.model_name, messages=_msgs("pick"), max_tokens=40,
                                       extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert r.choices[0].message.content in ("alpha", "beta")


def test_text_completion_under_json_object(client, stack):
    """json_object leaves keys unbounded: a random model may ramble in one until max_tokens, so
    several seeds run and every one that ends by the grammar is a JSON object."""
    done = 0
    for seed in range(6):
        r = client.completions.create(model=stack.model_name, prompt="{", max_tokens=200, temperature=1.0, seed=seed,
                                      extra_body={"response_format": {"type": "json_object"}})
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].text), dict)
            done += 1
        else:
            assert r.choices[0].text.startswith("{")
    assert done >= 1


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("body,words", [
    ({"structured_outputs": {"regex": "(unclosed"}}, ["regex"]),
    ({"structured_outputs": {"grammar": "root ::= nowhere"}}, ["grammar"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     ["json_schema"]),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, ["exactly one"]),
    ({"guided_json": {"type": "object"}}, ["guided_json", "structured_outputs"]),
    ({"response_format": {"type": "json_schema"}}, ["json_schema"]),
])
def test_a_schema_the_engine_cannot_honour_is_a_400(stack, body, words, stream):
    req = {"model": stack.model_name, "messages": _msgs(), "max_tokens": 20, "stream": stream, **body}
    r = httpx.post(f"{stack.url}/v1/chat/completions", json=req, timeout=60)
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert all(w in msg for w in words), msg
    assert "Traceback" not in msg and "xgrammar" not in msg.lower()
    # the server keeps serving
    ok = httpx.post(f"{stack.url}/v1/chat/completions", json={"model": stack.model_name, "messages": _msgs(),
                                                                "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200
