"""No /v1/responses field is accepted and ignored: every field of the official client's Responses
request types (the request; its function tools, tool_choice forms, ``text``, ``reasoning``,
``stream_options`` and ``include`` values; the input items and their content parts) is one this
server honours, one on the documented no-op lists (``RESPONSES_NOOP_FIELDS``,
``RESPONSES_INCLUDE_NOOP``, ``RESPONSES_ITEM_NOOP_FIELDS``), or refused with a 400 naming where
it is (``tools[0].type``, ``input[1].content[0].file_id``). A field a future ``openai`` release
adds fails here until someone decides."""

from __future__ import annotations

import collections.abc as cabc
import typing

import pydantic
import pytest
import typing_extensions as te
from fastapi.exceptions import RequestValidationError
from openai.types.responses import response_create_params as create_params
from openai.types.responses import response_input_item_param as item_param
from openai.types.responses import response_output_message_param as output_message_param
from openai.types.responses import response_text_config_param as text_param
from openai.types.responses import tool_param
from openai.types.shared_params import reasoning as reasoning_param

from gateway.errors import validation_message
from gateway.openai_api.requests import ChatCompletionRequest
from gateway.openai_api.responses_api import (
    RESPONSES_INCLUDABLE, RESPONSES_INCLUDE_NOOP, RESPONSES_ITEM_NOOP_FIELDS, RESPONSES_ITEM_UNSUPPORTED,
    RESPONSES_NOOP_FIELDS, RESPONSES_UNSUPPORTED, ResponsesReasoning, ResponsesRequest, ResponsesStreamOptions,
    ResponsesText, ResponsesTool,
)
from gateway.openai_api.responses_format import InputError, to_chat
from tests.unit.test_request_fields import PROBE, _with, field_paths

pytestmark = pytest.mark.unit

BASE = {"model": "m", "input": "x"}
TOOL = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}, "strict": True}


def _outcome(body: dict) -> ChatCompletionRequest | tuple[str, str | None]:
    """The chat request ``body`` becomes, or the 400's (message, param) as the gateway words it."""
    try:
        req = ResponsesRequest.model_validate(body)
    except pydantic.ValidationError as e:
        return validation_message(RequestValidationError([{**x, "loc": ("body", *x["loc"])} for x in e.errors()]))
    try:
        return to_chat(req)
    except InputError as e:
        return str(e), e.param


def _ok(body: dict) -> ChatCompletionRequest:
    out = _outcome(body)
    assert isinstance(out, ChatCompletionRequest), (body, out)
    return out


def _refused_at(body: dict, param: str) -> str:
    out = _outcome(body)
    assert isinstance(out, tuple) and out[1] == param, (body, out)
    return out[0]


def _values(hint) -> list:
    """Values a client would send for a field of this type (every value of a Literal)."""
    origin, args = te.get_origin(hint), te.get_args(hint)
    if origin is te.Literal:
        return list(args)
    if origin is typing.Union:
        return [v for a in args if a is not type(None) for v in _values(a)]
    if te.is_typeddict(hint):
        return [{}]
    if origin in (dict, cabc.Mapping) or hint is dict:
        return [{"k": "v"}]
    if origin in (list, cabc.Iterable, cabc.Sequence):
        return [[]]
    return {str: ["v"], int: [1], float: [0.5], bool: [True, False]}.get(hint, ["v"])


def _type_values(td) -> tuple:
    """The ``type`` values of an openai TypedDict (its Literal, Optional or not)."""
    hint = te.get_type_hints(td)["type"]
    return tuple(v for a in (hint, *te.get_args(hint)) if te.get_origin(a) is te.Literal for v in te.get_args(a))


# --- the request -----------------------------------------------------------------------------

REQUEST_HINTS = te.get_type_hints(create_params.ResponseCreateParamsStreaming)  # the base and ``stream``
# honoured request fields -> (a value, what the chat request then holds)
HONOURED = {
    "model": ("m", lambda c: c.model == "m"),
    "input": ([{"role": "user", "content": "q"}], lambda c: c.messages[-1].content == "q"),
    "instructions": ("be brief", lambda c: (c.messages[0].role, c.messages[0].content) == ("system", "be brief")),
    "max_output_tokens": (7, lambda c: c.max_tokens == 7),
    "temperature": (0.3, lambda c: c.temperature == 0.3),
    "top_p": (0.9, lambda c: c.top_p == 0.9),
    "stream": (True, lambda c: c.stream and c.stream_options.include_usage),
    "tools": ([TOOL], lambda c: c.tools[0].function.name == "f" and c.tools[0].function.strict is True),
    "tool_choice": ({"type": "function", "name": "f"}, lambda c: c.tool_choice.function.name == "f"),
    "parallel_tool_calls": (False, lambda c: c.parallel_tool_calls is False),
    "text": ({"format": {"type": "json_schema", "name": "n", "description": "d", "schema": {"type": "object"},
                         "strict": True}},
             lambda c: c.response_format.json_schema.model_dump(by_alias=True) == {
                 "name": "n", "description": "d", "schema": {"type": "object"}, "strict": True}),
    "reasoning": ({"effort": "low"}, lambda c: c.reasoning_effort == "low"),
    "include": (["message.output_text.logprobs"], lambda c: c.logprobs),
    "top_logprobs": (3, lambda c: c.logprobs and c.top_logprobs == 3),
}


def test_every_request_field_is_honoured_noop_or_refused():
    fields = sorted(REQUEST_HINTS)
    honoured = {f for f in fields if f in ResponsesRequest.model_fields and f not in RESPONSES_NOOP_FIELDS}
    # a newly honoured field gets its known answer below (NESTED ones are walked field by field)
    assert honoured - set(NESTED) == set(HONOURED) - set(NESTED)
    for name in fields:
        if name in honoured:
            continue
        if name in RESPONSES_UNSUPPORTED:  # only its do-nothing values pass
            allowed, why = RESPONSES_UNSUPPORTED[name]
            for ok in allowed:
                _ok({**BASE, name: ok})
            assert why in _refused_at({**BASE, name: PROBE}, name)
        elif name in RESPONSES_NOOP_FIELDS:
            for value in _values(REQUEST_HINTS[name]):
                _ok({**BASE, name: value})
        else:
            assert "unknown field" in _refused_at({**BASE, name: PROBE}, name)
    assert {"user", "metadata", "service_tier", "safety_identifier", "prompt_cache_key", "max_tool_calls"} <= \
        {f for f in fields if f in RESPONSES_NOOP_FIELDS}
    for name, allowed in (("store", True), ("background", True), ("truncation", "auto"),
                          ("previous_response_id", "resp_1")):
        _refused_at({**BASE, name: allowed}, name)


@pytest.mark.parametrize("name", sorted(HONOURED))
def test_an_honoured_request_field_lands_in_the_chat_request(name):
    value, holds = HONOURED[name]
    body = {**BASE, name: value}
    if name == "tool_choice":
        body["tools"] = [TOOL]
    assert holds(_ok(body))


# nested request objects: the openai type and our model of it
NESTED = {"text": (text_param.ResponseTextConfigParam, ResponsesText),
          "reasoning": (reasoning_param.Reasoning, ResponsesReasoning),
          "stream_options": (create_params.StreamOptions, ResponsesStreamOptions)}


def _nested_paths(td, prefix: str = "") -> dict[str, list]:
    """``field_paths`` into every TypedDict of a union (``text.format``'s three forms)."""
    out: dict[str, list] = {}
    for name, hint in te.get_type_hints(td).items():
        nested = [a for a in (hint, *te.get_args(hint)) if te.is_typeddict(a)]
        for sub in nested:
            for path, values in _nested_paths(sub, f"{prefix}{name}.").items():
                out[path] = out.get(path, []) + [v for v in values if v not in out.get(path, [])]
        if not nested:
            out[prefix + name] = _values(hint)
    return out


def _model_field(model, path: str) -> bool:
    """Whether ``path`` (by the client's names) is a field of ``model`` or of its nested models."""
    head, _, rest = path.partition(".")
    fields = {(f.alias or n): f for n, f in model.model_fields.items()}
    if head not in fields:
        return False
    if not rest:
        return True
    sub = [a for a in (fields[head].annotation, *te.get_args(fields[head].annotation))
           if isinstance(a, type) and issubclass(a, pydantic.BaseModel)]
    return bool(sub) and _model_field(sub[0], rest)


@pytest.mark.parametrize("name", sorted(NESTED))
def test_every_nested_field_is_honoured_noop_or_refused(name):
    td, model = NESTED[name]
    for path, values in sorted(_nested_paths(td).items()):
        full = f"{name}.{path}"
        if full in RESPONSES_NOOP_FIELDS or _model_field(model, path):
            for value in values:  # each value is served or refused where it is
                body = {**BASE, name: _with({}, path, value)}
                if path.startswith("format.") and path != "format.type":
                    body[name]["format"].setdefault("type", "json_schema")
                    body[name]["format"].setdefault("name", "n")
                out = _outcome(body)
                assert isinstance(out, ChatCompletionRequest) or out[1] == full, (full, value, out)
        else:
            _refused_at({**BASE, name: _with({}, path, PROBE)}, full)


def test_text_format_and_verbosity():
    assert _ok({**BASE, "text": {"format": {"type": "json_object"}}}).response_format.type == "json_object"
    assert _ok({**BASE, "text": {"format": {"type": "text"}, "verbosity": "medium"}}).response_format is None
    _refused_at({**BASE, "text": {"verbosity": "high"}}, "text.verbosity")


def test_every_tool_field_is_honoured_noop_or_refused():
    kinds = {}
    for td in te.get_args(tool_param.ToolParam):
        for kind in _type_values(td):
            kinds[kind] = td
    assert "function" in kinds and {"web_search", "file_search", "computer_use_preview", "mcp"} <= set(kinds)
    for kind in sorted(set(kinds) - {"function"}):  # built-in tools: a 400 naming the type
        msg = _refused_at({**BASE, "tools": [TOOL, {"type": kind}]}, "tools[1].type")
        assert repr(kind) in msg and "function tools" in msg
    for name, hint in sorted(te.get_type_hints(kinds["function"]).items()):
        path = f"tools[].{name}"
        if name in ResponsesTool.model_fields or path in RESPONSES_NOOP_FIELDS:
            for value in _values(hint):
                _ok({**BASE, "tools": [{**TOOL, name: value}]})
            continue
        allowed, why = RESPONSES_UNSUPPORTED[path]  # else: no do-nothing value -> KeyError, decide it
        for ok in allowed:
            _ok({**BASE, "tools": [{**TOOL, name: ok}]})
        assert why in _refused_at({**BASE, "tools": [{**TOOL, name: PROBE}]}, f"tools[0].{name}")
    assert "unknown field" in _refused_at({**BASE, "tools": [{**TOOL, "bogus": 1}]}, "tools[0].bogus")


def test_every_tool_choice_form_is_honoured_or_refused():
    forms = te.get_args(te.get_type_hints(create_params.ResponseCreateParamsBase)["tool_choice"])
    seen = set()
    for form in forms:
        if te.get_origin(form) is te.Literal:
            for value in te.get_args(form):  # none / auto / required
                assert _ok({**BASE, "tools": [TOOL], "tool_choice": value}).tool_choice == value
                seen.add(value)
            continue
        for kind in _type_values(form):
            seen.add(kind)
            if kind == "function":
                assert set(te.get_type_hints(form)) == {"type", "name"}
                continue  # honoured: HONOURED["tool_choice"]
            msg = _refused_at({**BASE, "tools": [TOOL], "tool_choice": {"type": kind}}, "tool_choice.type")
            assert kind in msg
    assert {"none", "auto", "required", "function", "allowed_tools", "web_search_preview", "mcp"} <= seen


def test_every_include_value_is_honoured_noop_or_refused():
    hint = REQUEST_HINTS["include"]
    values = [v for a in te.get_args(hint) for b in (a, *te.get_args(a)) if te.get_origin(b) is te.Literal
              for v in te.get_args(b)]
    assert "message.output_text.logprobs" in values and "reasoning.encrypted_content" in values
    for value in values:
        if value in RESPONSES_INCLUDABLE or value in RESPONSES_INCLUDE_NOOP:
            _ok({**BASE, "include": [value]})
        else:
            assert repr(value) in _refused_at({**BASE, "include": ["message.output_text.logprobs", value]},
                                              "include[1]")
    assert ResponsesRequest.model_validate({**BASE, "include": ["reasoning.encrypted_content"]}).include == []


# --- input items -----------------------------------------------------------------------------

ITEMS = {  # a valid item of each type served
    "message": {"type": "message", "role": "assistant", "content": "x"},
    "function_call": {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
    "function_call_output": {"type": "function_call_output", "call_id": "c1", "output": "ok"},
    "reasoning": {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "t"}]},
}
ITEM_HONOURED = {("message", "role"), ("message", "content"), ("function_call", "call_id"), ("function_call", "id"),
                 ("function_call", "name"), ("function_call", "arguments"), ("function_call_output", "call_id"),
                 ("function_call_output", "output"), ("function_call_output", "name"), ("reasoning", "summary"),
                 ("reasoning", "content")}


def _item_types() -> dict[str, list]:
    """Item type -> the openai TypedDicts of that type (a message has three)."""
    out: dict[str, list] = {}
    for td in te.get_args(item_param.ResponseInputItemParam):
        for kind in _type_values(td):
            out.setdefault(kind, []).append(td)
    return out


def _input(item: dict) -> dict:
    return {**BASE, "input": [{"role": "user", "content": "hi"}, item]}


def test_every_input_item_field_is_honoured_noop_or_refused():
    types = _item_types()
    assert set(ITEMS) <= set(types) and len(types) > 10  # the walk sees the client's item types
    seen = set()
    for kind, tds in sorted(types.items()):
        if kind not in ITEMS:
            assert kind in _refused_at(_input({"type": kind, "id": "x"}), "input[1].type")
            continue
        hints = {name: hint for td in tds for name, hint in te.get_type_hints(td).items() if name != "type"}
        for name, hint in sorted(hints.items()):
            key = f"{kind}.{name}"
            if (kind, name) in ITEM_HONOURED:
                seen.add((kind, name))
            elif key in RESPONSES_ITEM_NOOP_FIELDS:
                for value in _values(hint):
                    _ok(_input({**ITEMS[kind], name: value}))
            else:
                for ok in RESPONSES_ITEM_UNSUPPORTED.get(key, ((), ""))[0]:
                    _ok(_input({**ITEMS[kind], name: ok}))
                _refused_at(_input({**ITEMS[kind], name: PROBE}), f"input[1].{name}")
        _refused_at(_input({**ITEMS[kind], "bogus": 1}), "input[1].bogus")
    assert seen == ITEM_HONOURED
    assert "stored items" in _refused_at(_input({"id": "msg_1"}), "input[1].type")  # an item reference
    _refused_at(_input({**ITEMS["message"], "phase": "commentary"}), "input[1].phase")


def test_honoured_item_fields_land_in_the_chat_messages():
    chat = _ok({**BASE, "input": [
        {"role": "user", "content": "time?"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "S"}],
         "content": [{"type": "reasoning_text", "text": "R"}], "encrypted_content": None},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "clock", "arguments": '{"z":1}',
         "status": "completed"},
        {"type": "function_call", "id": "fc_2", "name": "clock", "arguments": "{}"},  # no call_id: its id
        {"type": "function_call_output", "call_id": "c1", "output": "12:00", "name": "clock"},
        {"type": "function_call_output", "call_id": "fc_2", "output": [{"type": "input_text", "text": "a"},
                                                                       {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "id": "m", "status": "completed", "phase": "final_answer",
         "content": [{"type": "output_text", "text": "It is ", "annotations": [], "logprobs": []},
                     {"type": "refusal", "refusal": "noon"}]}]})
    m = [x.model_dump(exclude_none=True) for x in chat.messages]
    assert m[0] == {"role": "user", "content": "time?"}
    assert m[1]["reasoning_content"] == "RS"
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in m[1]["tool_calls"]] == [
        ("c1", "clock", '{"z":1}'), ("fc_2", "clock", "{}")]
    assert m[2] == {"role": "tool", "tool_call_id": "c1", "content": "12:00", "name": "clock"}
    assert m[3]["tool_call_id"] == "fc_2" and [p["text"] for p in m[3]["content"]] == ["a", "b"]
    assert m[4]["role"] == "assistant" and [p["text"] for p in m[4]["content"]] == ["It is ", "noon"]


# --- content parts ---------------------------------------------------------------------------

def _part_types() -> dict[str, dict[str, tuple]]:
    """Container (``content``: a message's, ``output``: a function call output's) -> part type ->
    (its openai TypedDict, ...)."""
    message_parts = te.get_args(te.get_args(te.get_type_hints(item_param.Message)["content"])[0])
    output_parts = te.get_args(te.get_args(te.get_type_hints(output_message_param.ResponseOutputMessageParam)
                                           ["content"])[0])
    output = te.get_type_hints(item_param.FunctionCallOutput)["output"]
    tool_parts = te.get_args(te.get_args([a for a in te.get_args(output) if a is not str][0])[0])
    out: dict[str, dict[str, tuple]] = {"content": {}, "output": {}}
    for where, tds in (("content", message_parts + output_parts), ("output", tool_parts)):
        for td in tds:
            for kind in _type_values(td):
                out[where][kind] = out[where].get(kind, ()) + (td,)
    return out


PARTS = {  # a valid part of each type served
    "input_text": {"type": "input_text", "text": "x"},
    "input_image": {"type": "input_image", "image_url": "https://example.com/a.png"},
    "output_text": {"type": "output_text", "text": "x"},
    "refusal": {"type": "refusal", "refusal": "x"},
}
PART_NOT_SERVED = {"input_file"}
PART_HONOURED = {("input_text", "text"): "text", ("output_text", "text"): "text", ("refusal", "refusal"): "text",
                 ("input_image", "image_url"): "image_url.url"}


def _part_input(where: str, part: dict) -> dict:
    if where == "output":
        return _input({**ITEMS["function_call_output"], "output": [part]})
    role = "assistant" if part["type"] in ("output_text", "refusal") else "user"
    return _input({"type": "message", "role": role, "content": [part]})


def _get(obj, path: str):
    for key in path.split("."):
        obj = getattr(obj, key)
    return obj


@pytest.mark.parametrize("where", ["content", "output"])
def test_every_content_part_field_is_honoured_noop_or_refused(where):
    types = _part_types()[where]
    assert set(types) <= set(PARTS) | PART_NOT_SERVED and {"input_text", "input_image", "input_file"} <= set(types)
    seen, noop = set(), set()
    for kind, tds in sorted(types.items()):
        if kind in PART_NOT_SERVED:
            msg = _refused_at(_part_input(where, {"type": kind, "file_id": "f"}), f"input[1].{where}[0].type")
            assert kind.split("_")[1] in msg
            continue
        paths = {p: v for td in tds for p, v in field_paths(td).items()}
        for path, values in sorted(paths.items()):
            top = path.split(".")[0]
            key = f"{kind}.{top}"
            for value in values:
                body = _part_input(where, _with(PARTS[kind], path, value))
                if (kind, path) in PART_HONOURED:
                    seen.add((kind, path))
                    assert _get(_ok(body).messages[1].content[0], PART_HONOURED[kind, path]) == value
                elif key in RESPONSES_ITEM_NOOP_FIELDS:
                    noop.add(key)
                    _ok(body)
                elif value in RESPONSES_ITEM_UNSUPPORTED.get(key, ((), ""))[0]:
                    _ok(body)
                else:
                    _refused_at(body, f"input[1].{where}[0].{top}")
            if (kind, path) not in PART_HONOURED and key not in RESPONSES_ITEM_NOOP_FIELDS:
                _refused_at(_part_input(where, _with(PARTS[kind], path, PROBE)), f"input[1].{where}[0].{top}")
        _refused_at(_part_input(where, {**PARTS[kind], "bogus": 1}), f"input[1].{where}[0].bogus")
    assert seen == {k for k in PART_HONOURED if k[0] in types}
    assert where == "output" or {"input_image.detail", "output_text.annotations", "output_text.logprobs"} <= noop


def test_part_type_and_role_refusals_name_where():
    assert "belong to assistant" in _refused_at(
        _input({"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}), "input[1].content[0].type")
    _refused_at(_input({"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}),
                "input[1].content[0].file_id")
    _refused_at(_input({"role": "user", "content": [{"type": "input_image", "detail": "low"}]}),
                "input[1].content[0].image_url")
    out = _ok(_input({"role": "user", "content": [{**PARTS["input_image"], "detail": "high", "file_id": None}]}))
    assert out.messages[1].content[0].image_url.url == PARTS["input_image"]["image_url"]
    _refused_at(_input({"type": "reasoning", "summary": [{"type": "summary_text", "text": "s", "x": 1}]}),
                "input[1].summary[0].x")
    _refused_at(_input({**ITEMS["reasoning"], "encrypted_content": "gAAA"}), "input[1].encrypted_content")



def test_a_type_that_is_not_a_string_is_a_400_not_a_500():
    _refused_at(_input({"role": "user", "content": [{"type": {}, "text": "x"}]}), "input[1].content[0].type")
    _refused_at(_input({"type": ["message"], "role": "user", "content": "x"}), "input[1].type")


@pytest.mark.parametrize("tools", [True, 3, "get_weather", {"type": "function"}])
def test_tools_of_the_wrong_type_are_a_validation_error_not_a_crash(tools):
    """A fuzzed body (``tools: true``) reached the unsupported-tool check, which iterated it: a 500."""
    with pytest.raises(pydantic.ValidationError) as e:
        ResponsesRequest.model_validate({**BASE, "tools": tools})
    assert any(err["loc"][0] == "tools" for err in e.value.errors())
