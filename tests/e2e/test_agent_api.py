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

from mmserve.launcher import LocalStack, StackSpec

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


# ---- tools ----------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo", "Lima"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}


def _calls_valid(calls) -> None:
    assert calls and len({c.id for c in calls}) == len(calls)
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


@pytest.mark.parametrize("parallel", [True, False])
def test_tool_choice_required_gives_valid_calls(client, stack, parallel):
    """The calls follow the tools' schemas. A random model may keep adding parallel calls until
    max_tokens, so seeds are tried until one ends by itself; its stream, with the same seed,
    gives the same calls piece by piece."""
    kw = dict(model=stack.model_name, messages=_msgs("What is the weather in Paris?"), tools=[WEATHER, CLOCK],
              tool_choice="required", parallel_tool_calls=parallel, max_tokens=200, temperature=1.0)
    for seed in range(8):
        r = client.chat.completions.create(**kw, seed=seed)
        msg = r.choices[0].message
        if r.choices[0].finish_reason == "tool_calls":
            break
        assert r.choices[0].finish_reason == "length"
    else:
        pytest.fail("no seed ended its tool calls within max_tokens")
    assert msg.content is None
    _calls_valid(msg.tool_calls)
    if not parallel:
        assert len(msg.tool_calls) == 1
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kw, seed=seed, stream=True):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for t in ch.delta.tool_calls or ():
                c = calls.setdefault(t.index, {"name": "", "arguments": ""})
                c["name"] += t.function.name or ""
                c["arguments"] += t.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == \
        [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls]


def test_a_named_function_is_called_and_finishes_with_stop(client, stack):
    r = client.chat.completions.create(model=stack.model_name, messages=_msgs("time?"), tools=[WEATHER, CLOCK],
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       max_tokens=100, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop" and [c.function.name for c in calls] == ["get_time"]
    _calls_valid(calls)


def test_a_named_call_streams_its_arguments_in_pieces(client, stack):
    """Streamed, a two-parameter call's id and name come on its first delta only and its
    arguments in several pieces that concatenate to the non-streamed call's (greedy: the same
    tokens both ways)."""
    kw = dict(model=stack.model_name, messages=_msgs("weather?"), tools=[WEATHER, CLOCK],
              tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=100, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    _calls_valid(whole)
    pieces = [t for chunk in client.chat.completions.create(**kw, stream=True) for ch in chunk.choices
              for t in ch.delta.tool_calls or ()]
    assert pieces[0].id.startswith("call_") and pieces[0].function.name == "get_weather"
    assert all(p.index == 0 and p.id is None and p.function.name is None for p in pieces[1:])
    args = [p.function.arguments or "" for p in pieces]
    assert len([a for a in args if a]) > 1 and "".join(args) == whole[0].function.arguments


def test_tool_history_is_rendered_by_the_template(client, stack):
    """An assistant tool call and the tool's answer in the history reach the prompt (the prompt
    grows by them) and the model answers after them."""
    base = _msgs("What is the weather in Paris?")
    call = {"id": "call_abc", "type": "function", "function": {"name": "get_weather",
                                                                "arguments": '{"city": "Paris", "days": 2}'}}
    turns = base + [{"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_abc", "content": "sunny, 21 C"}]
    short = client.chat.completions.create(model=stack.model_name, messages=base, tools=[WEATHER], max_tokens=4)
    long = client.chat.completions.create(model=stack.model_name, messages=turns, tools=[WEATHER], max_tokens=4)
    assert long.usage.prompt_tokens > short.usage.prompt_tokens + 10
    tok = httpx.post(f"{stack.url}/tokenize", json={"model": stack.model_name, "messages": turns}, timeout=30)
    assert tok.status_code == 200


@pytest.mark.parametrize("body,words", [
    ({"tool_choice": "required"}, ["required", "tools"]),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, ["nope"]),
    ({"tools": [WEATHER, WEATHER]}, ["unique"]),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, ["tool_choice"]),
    ({"chat_template_kwargs": {"tools": []}}, ["chat_template_kwargs"]),
])
def test_bad_tool_requests_are_400s(stack, body, words):
    r = httpx.post(f"{stack.url}/v1/chat/completions", json={"model": stack.model_name, "messages": _msgs(),
                                                               "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert all(w in r.json()["error"]["message"] for w in words), r.text


def test_agents_sdk_runs_a_tool_loop(stack):
    """The OpenAI Agents SDK (chat-completions model) with tool_choice required: the model calls
    the tool with valid arguments, the SDK runs it, and the run ends on its result."""
    import asyncio

    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    seen: list[tuple[str, int]] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Tokyo", "Lima"], days: Literal[1, 2, 3]) -> str:
        """Weather in a city for some days."""
        seen.append((city, days))
        return f"{city}: sunny for {days} days"

    model = OpenAIChatCompletionsModel(model=stack.model_name, openai_client=openai.AsyncOpenAI(
        base_url=f"{stack.url}/v1", api_key="unused", max_retries=0))
    agent = Agent(name="weather", instructions="Use the tool.", tools=[get_weather], model=model,
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=100,
                                               temperature=0),
                  tool_use_behavior="stop_on_first_tool")
    result = asyncio.run(Runner.run(agent, "Weather in Lima?", max_turns=3))
    assert len(seen) >= 1 and seen[0][0] in ("Paris", "Tokyo", "Lima")
    assert result.final_output == f"{seen[0][0]}: sunny for {seen[0][1]} days"


# ---- n ----------------------------------------------------------------------------------------
def _prefix_hits(stack) -> float:
    text = httpx.get(f"{stack.llms[0].url}/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("mmserve_llm_prefix_hit_tokens_total"))


def test_n_choices_share_one_prefill(client, stack):
    msgs = _msgs("tell me a long story about " + " ".join(["cats"] * 60))
    before = _prefix_hits(stack)
    r = client.chat.completions.create(model=stack.model_name, messages=msgs, n=4, max_tokens=8, temperature=1.0,
                                       seed=3)
    hits = _prefix_hits(stack) - before
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert len({c.message.content for c in r.choices}) > 1  # seeds 3..6: distinct samples
    p = r.usage.prompt_tokens
    assert hits >= 3 * (p - 1)  # choices 2..4 found all but the last prompt token cached
    again = client.chat.completions.create(model=stack.model_name, messages=msgs, n=4, max_tokens=8,
                                           temperature=1.0, seed=3)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    # streamed: every choice finishes, usage counts the prompt once
    finished, pieces = set(), {}
    usage = None
    for chunk in client.chat.completions.create(model=stack.model_name, messages=msgs, n=3, max_tokens=8,
                                                temperature=1.0, seed=3, stream=True,
                                                stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for ch in chunk.choices:
            pieces[ch.index] = pieces.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1, 2} and usage.prompt_tokens == p
    assert [pieces[i] for i in range(3)] == [c.message.content for c in r.choices[:3]]


# ---- reasoning -------------------------------------------------------------------------------
def _chat(stack, **kw) -> dict:
    r = httpx.post(f"{stack.url}/v1/chat/completions", json={"model": stack.model_name, "messages": _msgs("hi"),
                                                               "max_tokens": 12, **kw}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_reasoning_is_split_from_content_as_the_template_opens_it(stack):
    """enable_thinking: MiMo's template opens <think>, so until the model closes it the output is
    reasoning (a random model never does: all of it); off, it is all content; include_reasoning
    false drops it; streamed deltas carry the same reasoning; passed back, it is rendered."""
    on = _chat(stack, chat_template_kwargs={"enable_thinking": True})
    msg = on["message"]
    assert msg["reasoning_content"] and msg["reasoning"] == msg["reasoning_content"] and not msg["content"]
    off = _chat(stack, chat_template_kwargs={"enable_thinking": False})["message"]
    assert off["content"] and "reasoning_content" not in off
    hidden = _chat(stack, chat_template_kwargs={"enable_thinking": True}, include_reasoning=False)["message"]
    assert "reasoning_content" not in hidden
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", timeout=60, json={
            "model": stack.model_name, "messages": _msgs("hi"), "max_tokens": 12, "stream": True,
            "chat_template_kwargs": {"enable_thinking": True}}) as r:
        deltas = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in deltas if c["choices"])
    assert streamed == msg["reasoning_content"]
    turns = _msgs("hi") + [{"role": "assistant", "content": "ok", "reasoning_content": "I think so"},
                           {"role": "user", "content": "and?"}]
    plain = _msgs("hi") + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and?"}]
    n = [httpx.post(f"{stack.url}/tokenize", json={"model": stack.model_name, "messages": m}, timeout=30).json()["count"]
         for m in (turns, plain)]
    assert n[0] > n[1]


# ---- /v1/responses ---------------------------------------------------------------------------
def test_responses_text_schema_and_stream(client, stack):
    r = client.responses.create(model=stack.model_name, input="Say hi", instructions="Be brief.",
                                max_output_tokens=12, temperature=0)
    assert r.status in ("completed", "incomplete") and r.output_text and r.usage.output_tokens >= 1
    schema = {"type": "object", "properties": {"w": {"enum": ["red", "green"]}}, "required": ["w"],
              "additionalProperties": False}
    j = client.responses.create(model=stack.model_name, input="a color as JSON", max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "c", "schema": schema, "strict": True}})
    assert json.loads(j.output_text)["w"] in ("red", "green")
    events = list(client.responses.create(model=stack.model_name, input="Say hi", instructions="Be brief.",
                                          max_output_tokens=12, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in ("response.completed",
                                                                                        "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_function_calls_and_their_outputs(client, stack):
    tools = [{"type": "function", "name": "get_time", "parameters": SCHEMAS["get_time"]}]
    r = client.responses.create(model=stack.model_name, input="time?", tools=tools, tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_time"
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS["get_time"])
    follow = client.responses.create(model=stack.model_name, tools=tools, max_output_tokens=8, input=[
        {"role": "user", "content": "time?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_time", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "12:00"}])
    assert follow.usage.input_tokens > r.usage.input_tokens
    bad = httpx.post(f"{stack.url}/v1/responses", timeout=30, json={"model": stack.model_name, "input": "x",
                                                                      "previous_response_id": "resp_1"})
    assert bad.status_code == 400 and "previous_response_id" in bad.json()["error"]["message"]
    bad = httpx.post(f"{stack.url}/v1/responses", timeout=30, json={"model": stack.model_name, "input": [
        {"type": "web_search_call"}]})
    assert bad.status_code == 400 and "web_search_call" in bad.json()["error"]["message"]


def test_responses_stream_function_call_arguments_in_deltas(client, stack):
    """function_call_arguments.delta events carry the arguments as they are generated; they
    concatenate to the .done event's and to the non-streamed call's arguments."""
    tools = [{"type": "function", "name": "get_weather", "parameters": SCHEMAS["get_weather"]}]
    kw = dict(model=stack.model_name, input="weather?", tools=tools, max_output_tokens=60, temperature=0,
              tool_choice={"type": "function", "name": "get_weather"})
    call = next(o for o in client.responses.create(**kw).output if o.type == "function_call")
    events = list(client.responses.create(**kw, stream=True))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert len(deltas) > 1 and done == ["".join(deltas)] and done[0] == call.arguments
    kinds = [e.type for e in events]
    added = next(e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call")
    assert added.item.name == "get_weather"
    assert events.index(added) < kinds.index("response.function_call_arguments.delta")


def test_responses_logprobs_streamed_and_not(client, stack):
    """``top_logprobs`` with ``include: ["message.output_text.logprobs"]``: every output token's
    logprob and alternatives on the output_text part (with bytes); streamed, the deltas' logprobs
    concatenate to the done event's, which equal the non-streamed ones; not asked: none."""
    kw = dict(model=stack.model_name, input="Say hi", max_output_tokens=8, temperature=0, top_logprobs=2,
              include=["message.output_text.logprobs"])
    r = client.responses.create(**kw)
    lps = next(o for o in r.output if o.type == "message").content[0].logprobs
    assert len(lps) == r.usage.output_tokens and r.top_logprobs == 2
    for lp in lps:
        assert len(lp.top_logprobs) == 2 and lp.bytes == list(lp.token.encode())
        assert abs(lp.logprob - lp.top_logprobs[0].logprob) < 1e-5  # greedy: the best alternative
    events = list(client.responses.create(**kw, stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done").logprobs
    assert [(x.token, x.logprob) for x in streamed] == [(x.token, x.logprob) for x in done]
    assert [x.token for x in done] == [x.token for x in lps]
    assert [x.logprob for x in done] == pytest.approx([x.logprob for x in lps], abs=1e-5)
    plain = client.responses.create(model=stack.model_name, input="Say hi", max_output_tokens=8, temperature=0)
    assert next(o for o in plain.output if o.type == "message").content[0].logprobs == []
    bad = httpx.post(f"{stack.url}/v1/responses", timeout=30, json={"model": stack.model_name, "input": "x",
                                                                      "include": ["file_search_call.results"]})
    assert bad.status_code == 400 and "file_search_call.results" in bad.json()["error"]["message"]


def test_agents_sdk_default_responses_model(stack):
    """The Agents SDK's default model (the Responses API) runs the same tool loop."""
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    seen = []

    @function_tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time in a zone."""
        seen.append(zone)
        return f"12:00 {zone}"

    model = OpenAIResponsesModel(model=stack.model_name, openai_client=openai.AsyncOpenAI(
        base_url=f"{stack.url}/v1", api_key="unused", max_retries=0))
    agent = Agent(name="clock", instructions="Use the tool.", tools=[get_time], model=model,
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=60,
                                               temperature=0, store=False),
                  tool_use_behavior="stop_on_first_tool")
    result = asyncio.run(Runner.run(agent, "What time is it?", max_turns=3))
    assert seen and result.final_output == f"12:00 {seen[0]}"


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_agents_sdk_default_tool_choice_with_strict_tools_is_enforced(stack, api):
    """The Agents SDK's defaults: tool_choice unset ("auto") and ``strict: true`` on every function
    tool. The output is held to the model's tool-call format (docs/api.md, strict tools under
    auto): the run ends, on a call whose arguments the SDK accepts or on plain text."""
    import asyncio

    from agents import (Agent, ModelBehaviorError, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel,
                        Runner, function_tool, set_tracing_disabled)

    set_tracing_disabled(True)
    seen = []

    @function_tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time in a zone."""
        seen.append(zone)
        return f"12:00 {zone}"

    assert get_time.strict_json_schema
    client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    model = (OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel)(
        model=stack.model_name, openai_client=client)
    settings = ModelSettings(max_tokens=60, temperature=1.0, **({} if api == "chat" else {"store": False}))
    agent = Agent(name="clock", instructions="Use the tool.", tools=[get_time], model=model, model_settings=settings,
                  tool_use_behavior="stop_on_first_tool")

    async def runs():
        for seed in range(3):
            seeded = agent.clone(model_settings=settings.resolve(ModelSettings(extra_body={"seed": seed})))
            try:
                result = await Runner.run(seeded, "What time is it?", max_turns=2)
            except ModelBehaviorError as e:  # the Responses model's answer to a text cut at max_tokens
                assert "max_output_tokens" in str(e), e
                continue
            assert result.final_output is not None

    asyncio.run(runs())
    assert all(z in ("UTC", "CET") for z in seen)
