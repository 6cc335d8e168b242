"""Strict schemas on every endpoint, through the real stack (gateway + ``swa`` LLM service on the
tiny random-weight MiMo): each enforced JSON Schema keyword, as chat ``response_format``, a chat
tool under tool_choice "required", Responses ``text.format`` and a Responses function tool,
streamed and not; every answer is checked with ``jsonschema`` (one cut at ``max_tokens`` says
``length`` / ``incomplete`` and is counted neither way). A keyword the grammar would drop is a
400 ``unsupported_schema_keyword`` on each endpoint and from the LLM service itself."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import jsonschema
import pytest

from gateway.app import create_app as gateway_app
from mmserve.testing.fake_services import ServerThread, fake_encoder_app
from shared.schemas import GenerateRequest, PromptMessage, PromptText, SamplingParams, StructuredSpec
from shared.settings import GatewaySettings, LLMSettings
from shared.wire import SAFETENSORS_MIME, pack
from tests.integration.test_llm_service import ServerThread as LLMThread
from tests.sse import sse_events

pytestmark = pytest.mark.integration
MODEL = "mmserve-tiny"
MAX_TOKENS = 48


def _obj(props: dict, **kw) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False, **kw}


# one schema per keyword, every string and number bounded so that a random model can finish
KEYWORDS = {
    "maxLength": _obj({"s": {"type": "string", "maxLength": 4}}),
    "minLength": _obj({"s": {"type": "string", "minLength": 2, "maxLength": 5}}),
    "pattern": _obj({"s": {"type": "string", "pattern": "^[a-z]{1,4}-[0-9]{2}$"}}),
    "enum": _obj({"e": {"enum": ["red", "green", 7, None]}}),
    "const": _obj({"c": {"const": "fixed"}, "k": {"type": "integer", "minimum": 0, "maximum": 9}}),
    "minimum/maximum": _obj({"i": {"type": "integer", "minimum": -3, "maximum": 12},
                             "x": {"type": "number", "minimum": 0.5, "maximum": 2.5}}),
    "minItems/maxItems": _obj({"a": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "minItems": 2, "maxItems": 3}}),
    "additionalProperties": _obj({"b": {"type": "boolean"}, "n": {"type": "null"}}),
    "$ref/$defs": _obj({"p": {"$ref": "#/$defs/P"}},
                       **{"$defs": {"P": _obj({"q": {"$ref": "#/$defs/Q"}}),
                                    "Q": {"type": "string", "enum": ["x", "yy"], "maxLength": 2}}}),
    "anyOf": _obj({"u": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5},
                                   {"type": "string", "maxLength": 3}]}}),
}
ENDPOINTS = ("chat.response_format", "chat.tools", "responses.text.format", "responses.tools")


@pytest.fixture(scope="module")
def stack(mimo_bundle):
    from llm_svc.front.app import create_app as llm_app

    # compact JSON: a random model would otherwise pad with whitespace until max_tokens
    settings = LLMSettings(model_dir=str(mimo_bundle), backend="swa", max_model_len=2048, kv_bytes=32 << 20,
                           structured_any_whitespace=False)
    with LLMThread(llm_app(settings)) as llm:
        enc = ServerThread(fake_encoder_app("e0")).start()
        gw = ServerThread(gateway_app(GatewaySettings(model_name=MODEL, encoder_urls=[enc.url], llm_urls=[llm.url],
                                                      health_interval=0, dns_interval=0))).start()
        yield {"gw": gw.url, "llm": llm.url}
        gw.stop()
        enc.stop()


def _body(endpoint: str, schema: dict, stream: bool, seed: int) -> tuple[str, dict]:
    common = {"model": MODEL, "temperature": 1.0, "seed": seed, "stream": stream}
    if endpoint.startswith("chat."):
        body = {**common, "messages": [{"role": "user", "content": "answer in JSON"}], "max_tokens": MAX_TOKENS}
        if endpoint == "chat.response_format":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "k", "schema": schema,
                                                                              "strict": True}}
        else:
            body.update(tools=[{"type": "function", "function": {"name": "f", "parameters": schema, "strict": True}}],
                        tool_choice="required", parallel_tool_calls=False)
        return "/v1/chat/completions", body
    body = {**common, "input": "answer in JSON", "max_output_tokens": MAX_TOKENS}
    if endpoint == "responses.text.format":
        body["text"] = {"format": {"type": "json_schema", "name": "k", "schema": schema, "strict": True}}
    else:
        body.update(tools=[{"type": "function", "name": "f", "parameters": schema, "strict": True}],
                    tool_choice="required", parallel_tool_calls=False)
    return "/v1/responses", body


def _answer(url: str, endpoint: str, schema: dict, stream: bool, seed: int) -> tuple[list[str], bool]:
    """(the JSON texts the schema governs: the content, or each call's arguments; cut at max_tokens)."""
    path, body = _body(endpoint, schema, stream, seed)
    tools = endpoint.endswith(".tools")
    with httpx.Client(timeout=180) as c:
        if not stream:
            r = c.post(url + path, json=body)
            assert r.status_code == 200, r.text
            out = r.json()
            if path == "/v1/chat/completions":
                ch = out["choices"][0]
                texts = [t["function"]["arguments"] for t in ch["message"].get("tool_calls") or ()] if tools \
                    else [ch["message"]["content"]]
                return texts, ch["finish_reason"] == "length"
            items = out["output"]
            texts = [i["arguments"] for i in items if i["type"] == "function_call"] if tools else \
                ["".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])]
            return texts, out["status"] == "incomplete"
        with c.stream("POST", url + path, json=body) as r:
            assert r.status_code == 200, r.read()
            if path == "/v1/chat/completions":
                content, calls, finish = [], {}, None
                for ev in sse_events(r):
                    for ch in ev["choices"]:
                        d = ch["delta"]
                        content.append(d.get("content") or "")
                        for t in d.get("tool_calls") or ():
                            calls[t["index"]] = calls.get(t["index"], "") + (t["function"].get("arguments") or "")
                        finish = ch.get("finish_reason") or finish
                texts = [calls[i] for i in sorted(calls)] if tools else ["".join(content)]
                return texts, finish == "length"
            text, args, last = [], {}, None
            for ev in sse_events(r):
                if ev["type"] == "response.output_text.delta":
                    text.append(ev["delta"])
                elif ev["type"] == "response.function_call_arguments.delta":
                    args[ev["output_index"]] = args.get(ev["output_index"], "") + ev["delta"]
                last = ev
            assert last["type"] in ("response.completed", "response.incomplete"), last
            texts = [args[i] for i in sorted(args)] if tools else ["".join(text)]
            return texts, last["type"] == "response.incomplete"


def test_every_enforced_keyword_holds_on_every_endpoint_streamed_and_not(stack):
    runs = [(kw, ep, stream, seed) for kw in KEYWORDS for ep in ENDPOINTS for stream in (False, True)
            for seed in (1,)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda r: _answer(stack["gw"], r[1], KEYWORDS[r[0]], r[2], r[3] + len(r[0])), runs))
    valid: dict[str, int] = {ep: 0 for ep in ENDPOINTS}
    cut = 0
    for (kw, ep, stream, _), (texts, was_cut) in zip(runs, answers):
        if was_cut:
            cut += 1
            continue
        assert texts, (kw, ep, stream)
        for text in texts:
            try:
                jsonschema.validate(json.loads(text), KEYWORDS[kw])
            except (ValueError, jsonschema.ValidationError) as e:
                pytest.fail(f"{kw} on {ep} (stream={stream}): {text!r} breaks the schema: {e}")
        valid[ep] += 1
    # a random model finishes most answers under a bounded schema: the check above saw real answers
    assert all(n >= len(KEYWORDS) for n in valid.values()), (valid, cut)


DROPPED = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 4}},
           "required": ["s"], "additionalProperties": False}
WHERE = {"chat.response_format": "response_format.json_schema.schema.properties.s",
         "chat.tools": "tools[0].function.parameters.properties.s",
         "responses.text.format": "text.format.schema.properties.s",
         "responses.tools": "tools[0].parameters.properties.s"}


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("stream", [False, True])
def test_a_keyword_the_grammar_would_drop_is_a_400_naming_it(stack, endpoint, stream):
    path, body = _body(endpoint, DROPPED, stream, 0)
    r = httpx.post(stack["gw"] + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "unsupported_schema_keyword" and err["param"] == WHERE[endpoint], err
    assert "'maxLength'" in err["message"] and "pattern" in err["message"], err


def test_the_llm_service_refuses_direct_callers(stack):
    req = GenerateRequest(request_id="direct", messages=[PromptMessage(role="user", content=[PromptText(text="hi")])],
                          sampling=SamplingParams(max_tokens=8, structured=StructuredSpec(kind="json",
                                                                                         spec=json.dumps(DROPPED))))
    r = httpx.post(stack["llm"] + "/v1/generate", content=pack({}, req), headers={"content-type": SAFETENSORS_MIME},
                   timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "unsupported_schema_keyword" and err["param"] == "sampling.structured.spec.properties.s"
