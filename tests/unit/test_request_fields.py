"""No request field is accepted and ignored: every field of the official client's request types
(chat and text completions, the message types and their content parts) is a field this server
honours, one on the documented no-op list, or refused with a 400 naming it."""

from __future__ import annotations

import copy

import pydantic
import pytest
import typing_extensions as te
from fastapi.exceptions import RequestValidationError
from openai.types import completion_create_params as text_params
from openai.types.chat import chat_completion_assistant_message_param as assistant_param
from openai.types.chat import chat_completion_content_part_param as part_param
from openai.types.chat import chat_completion_tool_message_param as tool_param
from openai.types.chat import completion_create_params as chat_params

from gateway.errors import validation_message
from gateway.openai_api.requests import NOOP_FIELDS, UNSUPPORTED_FIELDS, ChatCompletionRequest, CompletionRequest
from shared.schemas import PART_NOOP_FIELDS, ChatMessage

pytestmark = pytest.mark.unit

CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
TEXT = {"model": "m", "prompt": "x"}
PROBE = {"probe": True}  # a value no field of ours would take silently


def _refused(model, body: dict, name: str) -> None:
    with pytest.raises(pydantic.ValidationError) as e:
        model.model_validate(body)
    assert name in str(e.value)


@pytest.mark.parametrize("model,base,fields", [
    (ChatCompletionRequest, CHAT, sorted(chat_params.CompletionCreateParamsBase.__annotations__)),
    (CompletionRequest, TEXT, sorted(text_params.CompletionCreateParamsBase.__annotations__)),
])
def test_every_openai_request_field_is_honoured_noop_or_refused(model, base, fields):
    honoured = [f for f in fields if f in model.model_fields]
    noop = [f for f in fields if f in NOOP_FIELDS]
    rest = [f for f in fields if f not in honoured and f not in noop]
    assert len(honoured) >= 10  # the walk sees the real fields
    for name in rest:  # neither a field nor a no-op: a value that would change something is a 400
        _refused(model, {**base, name: PROBE}, name)
        if name in UNSUPPORTED_FIELDS:  # its do-nothing values pass
            for ok in UNSUPPORTED_FIELDS[name]:
                model.model_validate({**base, name: ok})


def test_every_message_field_is_honoured_noop_or_refused():
    fields = set(assistant_param.ChatCompletionAssistantMessageParam.__annotations__) | \
        set(tool_param.ChatCompletionToolMessageParam.__annotations__)
    honoured = {f for f in fields if f in ChatMessage.model_fields}
    assert {"role", "content", "tool_calls", "tool_call_id", "name"} <= honoured
    for name in sorted(fields - honoured):  # refusal, function_call, audio
        with pytest.raises(pydantic.ValidationError, match=name):
            ChatMessage.model_validate({"role": "assistant", "content": "x", name: PROBE})
        ChatMessage.model_validate({"role": "assistant", "content": "x", name: None})


def test_response_format_and_structured_outputs_together_are_refused():
    """Both constrain the output: one would be ignored, so both together are a 400."""
    _refused(ChatCompletionRequest, {**CHAT, "response_format": {"type": "json_object"},
                                     "structured_outputs": {"regex": "a+"}}, "structured_outputs")
    ChatCompletionRequest.model_validate({**CHAT, "response_format": {"type": "text"},
                                          "structured_outputs": {"regex": "a+"}})


# --- message content parts -------------------------------------------------------------------

PARTS = {  # a valid part of each type a client sends (refusal: in an assistant message; video_url: vLLM's)
    "text": {"type": "text", "text": "x"},
    "image_url": {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
    "input_audio": {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    "video_url": {"type": "video_url", "video_url": {"url": "https://example.com/a.mp4"}},
    "refusal": {"type": "refusal", "refusal": "x"},
}
NOT_SERVED = {"file"}  # the part itself is a 400 naming its type
HONOURED = {  # (part type, field) -> where the value lands in the parsed part
    ("text", "text"): "text", ("image_url", "image_url.url"): "image_url.url",
    ("input_audio", "input_audio.data"): "input_audio.data", ("video_url", "video_url.url"): "video_url.url",
    ("refusal", "refusal"): "text",  # an assistant's refusal part is its text, as vLLM reads it
}


def field_paths(td, prefix: str = "") -> dict[str, list]:
    """Every field path of an openai client's TypedDict (``image_url.detail``; into a nested
    TypedDict, the first of a union) -> values to send (a Literal's values; a sample string); the
    top ``type`` left out."""
    out: dict[str, list] = {}
    for name, hint in te.get_type_hints(td).items():
        nested = [a for a in (hint, *te.get_args(hint)) if te.is_typeddict(a)]
        if nested:
            out.update(field_paths(nested[0], f"{prefix}{name}."))
        elif name != "type" or prefix:
            out[prefix + name] = list(te.get_args(hint)) if te.get_origin(hint) is te.Literal else ["v"]
    return out


def _openai_part_fields() -> dict[str, dict[str, list]]:
    """Part type -> every field path of the openai client's part type -> values to send."""
    types = (*te.get_args(part_param.ChatCompletionContentPartParam),
             *te.get_args(assistant_param.ContentArrayOfContentPart))
    out: dict[str, dict[str, list]] = {}
    for td in types:
        kind = te.get_args(te.get_type_hints(td)["type"])[0]
        out.setdefault(kind, {}).update(field_paths(td))
    return out


def _request(part: dict) -> dict:
    role = "assistant" if part.get("type") == "refusal" else "user"
    return {**CHAT, "messages": [{"role": "user", "content": "hi"}, {"role": role, "content": [part]}]}


def _with(part: dict, path: str, value) -> dict:
    part = copy.deepcopy(part)
    *outer, last = path.split(".")
    d = part
    for key in outer:
        d = d.setdefault(key, {})
    d[last] = value
    return part


def _error_of(body: dict) -> tuple[str, str | None]:
    with pytest.raises(pydantic.ValidationError) as e:
        ChatCompletionRequest.model_validate(body)
    return validation_message(RequestValidationError([{**x, "loc": ("body", *x["loc"])} for x in e.value.errors()]))


def _get(obj, path: str):
    for key in path.split("."):
        obj = getattr(obj, key)
    return obj


def test_every_content_part_field_is_honoured_noop_or_refused():
    fields = _openai_part_fields()
    assert set(fields) == (set(PARTS) - {"video_url"}) | NOT_SERVED  # the walk sees the client's part types
    fields["video_url"] = {"video_url.url": ["v"]}
    seen = {"honoured": set(), "noop": set()}
    for kind, paths in sorted(fields.items()):
        if kind in NOT_SERVED:
            msg, param = _error_of(_request({"type": kind, kind: {}}))
            assert param == "messages[1].content[0].type" and kind in msg
            continue
        for path, values in sorted(paths.items()):
            noop = path in PART_NOOP_FIELDS or path.split(".")[0] in PART_NOOP_FIELDS
            for value in values:
                body = _request(_with(PARTS[kind], path, value))
                if (kind, path) not in HONOURED and not noop:
                    assert _error_of(body)[1] == f"messages[1].content[0].{path}", (kind, path)
                    continue
                part = ChatCompletionRequest.model_validate(body).messages[1].content[0]
                if (kind, path) in HONOURED:
                    seen["honoured"].add((kind, path))
                    assert _get(part, HONOURED[kind, path]) == value
                else:
                    seen["noop"].add(path)
    assert seen["honoured"] == set(HONOURED)
    assert {"image_url.detail", "input_audio.format", "prompt_cache_breakpoint.mode"} <= seen["noop"]


@pytest.mark.parametrize("kind", sorted(PARTS))
def test_an_unknown_part_field_is_refused_by_name(kind):
    msg, param = _error_of(_request({**PARTS[kind], "detail": "high"}))
    assert param == "messages[1].content[0].detail" and "remove it" in msg
    if kind in ("image_url", "input_audio", "video_url"):
        msg, param = _error_of(_request(_with(PARTS[kind], f"{kind}.uuid", "u")))
        assert param == f"messages[1].content[0].{kind}.uuid"


@pytest.mark.parametrize("part,why", [
    ({"type": "audio_url", "audio_url": {"url": "u"}}, "unknown content part type 'audio_url'"),
    ({"type": "refusal", "refusal": "no"}, "refusal parts belong to assistant messages"),  # in a user message
    ({"type": "file", "file": {"file_id": "f"}}, "file parts are not served"),
])
def test_a_part_type_not_served_is_refused_by_name(part, why):
    body = {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, part]}]}
    msg, param = _error_of(body)
    assert param == "messages[0].content[1].type" and why in msg and "text, image_url" in msg
