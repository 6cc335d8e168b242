"""No request field is accepted and ignored: every field of the official client's request types
(chat and text completions, and the message types) is a field this server honours, one on the
documented no-op list, or refused with a 400 naming it."""

from __future__ import annotations

import pydantic
import pytest
from openai.types import completion_create_params as text_params
from openai.types.chat import chat_completion_assistant_message_param as assistant_param
from openai.types.chat import chat_completion_tool_message_param as tool_param
from openai.types.chat import completion_create_params as chat_params

from shared.schemas import NOOP_FIELDS, UNSUPPORTED_FIELDS, ChatCompletionRequest, ChatMessage, CompletionRequest

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
