"""Strict function tools under tool_choice "auto" through the real stack (gateway + ``swa`` LLM
service on the tiny random-weight checkpoints): the output is held to the model's tool-call
format (``llm_svc.front.tool_tags``), so every call a request makes, in chat and in
``/v1/responses``, streamed and not, names one of the tools and a strict tool's arguments
validate (``jsonschema``). A random MiMo rarely writes its call trigger, so the MiMo runs show
that calls which happen validate and that the request is constrained at all (a strict schema
over the grammar size limit is refused, the same schema non-strict is not); the gpt-oss runs
bias ``<|end|>`` so that the grammar, which admits only message headers after it, makes calls
happen. Gemma 3 (no structural tag) refuses strict under "auto" with a 400 that says what to send.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json

import httpx
import jsonschema
import pytest

from gateway.app import create_app as gateway_app
from mmserve.testing.fake_services import ServerThread, fake_encoder_app
from shared.settings import GatewaySettings, LLMSettings
from tests.integration.test_llm_service import ServerThread as LLMThread
from tests.sse import sse_events

pytestmark = pytest.mark.integration
MODEL = "mmserve-tiny"

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "units": {"anyOf": [{"type": "string", "enum": ["C", "F"]}, {"type": "null"}]}},
    "required": ["city", "days", "units"], "additionalProperties": False}
LOOKUP = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["id"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "lookup": LOOKUP}
TOOLS = [{"name": "get_weather", "parameters": WEATHER, "strict": True},
         {"name": "lookup", "parameters": LOOKUP, "strict": True},
         {"name": "notes", "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}]


@contextlib.contextmanager
def serving(bundle, **llm):
    from llm_svc.front.app import create_app as llm_app

    settings = LLMSettings(model_dir=str(bundle), backend="swa", max_model_len=2048, kv_bytes=32 << 20,
                           structured_any_whitespace=False, **llm)
    with LLMThread(llm_app(settings)) as svc:
        enc = ServerThread(fake_encoder_app("e0")).start()
        gw = ServerThread(gateway_app(GatewaySettings(model_name=MODEL, encoder_urls=[enc.url], llm_urls=[svc.url],
                                                      health_interval=0, dns_interval=0))).start()
        try:
            yield gw.url
        finally:
            gw.stop()
            enc.stop()


@pytest.fixture(scope="module")
def mimo(mimo_bundle):
    with serving(mimo_bundle, max_grammar_bytes=1800) as url:
        yield url


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    from mmserve.tiny.gpt_oss import write_gpt_oss

    with serving(write_gpt_oss(tmp_path_factory.mktemp("oss") / "gpt-oss")) as url:
        yield url


def body(api: str, stream: bool, seed: int, tools=TOOLS, **extra) -> tuple[str, dict]:
    common = {"model": MODEL, "temperature": 1.0, "seed": seed, "stream": stream, "tool_choice": "auto", **extra}
    if api == "chat":
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": "weather in Rome?"}],
                                        "max_tokens": 96, "tools": [{"type": "function", "function": t} for t in tools]}
    return "/v1/responses", {**common, "input": "weather in Rome?", "max_output_tokens": 96,
                             "tools": [{"type": "function", **t} for t in tools]}


def calls_of(url: str, api: str, stream: bool, seed: int, **extra) -> tuple[list[tuple[str, str]], bool]:
    """The answer's calls as (name, arguments), and whether it was cut at the token limit."""
    path, b = body(api, stream, seed, **extra)
    with httpx.Client(timeout=180) as c:
        if not stream:
            r = c.post(url + path, json=b)
            assert r.status_code == 200, r.text
            out = r.json()
            if api == "chat":
                ch = out["choices"][0]
                calls = [(t["function"]["name"], t["function"]["arguments"])
                         for t in ch["message"].get("tool_calls") or ()]
                return calls, ch["finish_reason"] == "length"
            return ([(i["name"], i["arguments"]) for i in out["output"] if i["type"] == "function_call"],
                    out["status"] == "incomplete")
        with c.stream("POST", url + path, json=b) as r:
            assert r.status_code == 200, r.read()
            if api == "chat":
                calls, finish = {}, None
                for ev in sse_events(r):
                    for ch in ev["choices"]:
                        for t in ch["delta"].get("tool_calls") or ():
                            name, args = calls.get(t["index"], (None, ""))
                            calls[t["index"]] = (name or t["function"].get("name"),
                                                 args + (t["function"].get("arguments") or ""))
                        finish = ch.get("finish_reason") or finish
                return [calls[i] for i in sorted(calls)], finish == "length"
            names, args, last = {}, {}, None
            for ev in sse_events(r):
                if ev["type"] == "response.output_item.added" and ev["item"]["type"] == "function_call":
                    names[ev["output_index"]] = ev["item"]["name"]
                elif ev["type"] == "response.function_call_arguments.delta":
                    args[ev["output_index"]] = args.get(ev["output_index"], "") + ev["delta"]
                last = ev
            assert last["type"] in ("response.completed", "response.incomplete"), last
            return [(names[i], args.get(i, "")) for i in sorted(names)], last["type"] == "response.incomplete"


def check_calls(url: str, seeds: range, apis=("chat", "responses"), **extra) -> int:
    """Every complete answer's calls name a tool and a strict tool's arguments validate; the number
    of calls checked."""
    runs = [(api, stream, seed) for api in apis for stream in (False, True) for seed in seeds]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda r: calls_of(url, *r, **extra), runs))
    checked = 0
    for run, (calls, cut) in zip(runs, answers):
        for i, (name, args) in enumerate(calls):
            if cut and i == len(calls) - 1:
                continue  # the last call may be cut at max_tokens
            assert name in {t["name"] for t in TOOLS}, (run, name)
            value = json.loads(args)
            if name in SCHEMAS:
                try:
                    jsonschema.validate(value, SCHEMAS[name])
                except jsonschema.ValidationError as e:
                    pytest.fail(f"{run}: {name}({args}) breaks its strict schema: {e.message}")
            checked += 1
    return checked


def test_mimo_calls_that_happen_validate_on_both_apis_streamed_and_not(mimo):
    check_calls(mimo, range(4))


def test_mimo_strict_tool_under_auto_is_compiled_into_the_grammar(mimo):
    """The grammar is really built: a strict schema past ``max_grammar_bytes`` is refused; the
    same tool without strict puts nothing on the output and is served."""
    big = {**LOOKUP, "description": "the weather " * 100}  # its structural tag: 1.9 kB; TOOLS': 1.5 kB
    for strict in (True, False):
        tools = [{"name": "lookup", "parameters": big, "strict": strict}]
        for api in ("chat", "responses"):
            path, b = body(api, False, 0, tools=tools)
            r = httpx.post(mimo + path, json=b, timeout=120)
            if strict:
                assert r.status_code == 400 and "MAX_GRAMMAR_BYTES" in r.text and "tool_choice auto" in r.text, r.text
            else:
                assert r.status_code == 200, r.text


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_strict_auto_with_a_response_format_is_a_400_naming_both(mimo, api):
    extra = ({"response_format": {"type": "json_object"}} if api == "chat"
             else {"text": {"format": {"type": "json_object"}}})
    path, b = body(api, False, 0, **extra)
    r = httpx.post(mimo + path, json=b, timeout=60)
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "'get_weather' is strict" in msg and "response_format" in msg, msg


def test_gpt_oss_calls_happen_and_validate(gpt_oss):
    from mmserve.tiny.gpt_oss import HARMONY_SPECIALS, HARMONY_TEMPLATE
    from mmserve.tiny.tokenizer import build_tokenizer

    tok = build_tokenizer(HARMONY_SPECIALS, 640, HARMONY_TEMPLATE, eos="<|return|>", pad_token="<|endoftext|>")
    end = tok.convert_tokens_to_ids("<|end|>")
    # <|end|> at once: the grammar then admits only <|start|>assistant and a header, a call's among them
    # (chat only: /v1/responses has no logit_bias; there calls may or may not happen)
    assert check_calls(gpt_oss, range(4), apis=("chat",), logit_bias={str(end): 30}) >= 4
    check_calls(gpt_oss, range(2), apis=("responses",))


def test_gemma3_refuses_strict_under_auto_and_serves_the_rest(gemma3_bundle):
    with serving(gemma3_bundle) as url:
        for api in ("chat", "responses"):
            path, b = body(api, False, 0)
            r = httpx.post(url + path, json=b, timeout=60)
            assert r.status_code == 400, r.text
            msg = r.json()["error"]["message"]
            assert "tools[0] (function 'get_weather') is strict" in msg and 'tool_choice "required"' in msg, msg
            path, b = body(api, False, 0, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
            assert httpx.post(url + path, json=b, timeout=120).status_code == 200
