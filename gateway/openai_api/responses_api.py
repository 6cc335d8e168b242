"""OpenAI's ``POST /v1/responses`` request body (client -> gateway), stateless: every field of
OpenAI's request is honoured, a no-op, or a 400 naming it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError, ValidationError

from gateway.openai_api.requests import NOOP_FIELDS, REASONING_EFFORTS
from shared.schemas import MAX_TOP_LOGPROBS, PART_NOOP_FIELDS

# tests/unit/test_responses_fields.py walks the ``openai`` client's Responses types.

# Request fields (a path from the request) that change nothing here, accepted and ignored; chat's
# ``NOOP_FIELDS`` apply too.
RESPONSES_NOOP_FIELDS: dict[str, str] = {
    **NOOP_FIELDS,
    "max_tool_calls": "caps calls of built-in tools, which are not served (function calls are the client's)",
    "stream_options.include_obfuscation": "no padding field is added to stream events",
    "reasoning.summary": "the reasoning is given whole (reasoning_text), not summarized",
    "reasoning.generate_summary": "the old name of reasoning.summary",
    "tools[].output_schema": "describes a tool's output for programmatic callers, which are not served",
}
# Request fields that need what this server does not have: accepted only with the values listed
# (their defaults), else a 400 naming the field and why.
RESPONSES_UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "store": ((None, False), "this server keeps no responses; send store=false (or omit it)"),
    "previous_response_id": ((None,), "this server keeps no responses; send the whole conversation as input items"),
    "conversation": ((None,), "this server keeps no conversations; send the whole conversation as input items"),
    "prompt": ((None,), "stored prompt templates are not served; send the instructions and input"),
    "background": ((None, False), "a response is answered on its request (nothing is kept to poll)"),
    "background_options": ((None,), "background responses are not served"),
    "truncation": ((None, "disabled"), "an input longer than the context is a 400 here, never cut"),
    "context_management": ((None, []), "compaction is not served; send the input to use"),
    "prompt_cache_options": ((None,), "prefix caching here is automatic (no breakpoints, lifetimes or prewarm)"),
    "prompt_cache_retention": ((None,), "prefix caching here is automatic (no retention policy)"),
    "moderation": ((None,), "no moderation model is served"),
    "access_programs": ((None,), "no access programs here"),
    "image": ((None, {}, {"context_compression": "auto"}), "image context compression is not served"),
    "tools[].defer_loading": ((None, False), "tool search is not served; send the tools to use"),
    "tools[].allowed_callers": ((None, ["direct"]), "programmatic tool calling is not served"),
    "tools[].async": ((None, False), "a call's output is awaited before the model goes on"),
}
# ``include`` values that change nothing here (``RESPONSES_INCLUDABLE`` are served; others: 400)
RESPONSES_INCLUDE_NOOP: dict[str, str] = {
    "reasoning.encrypted_content": "reasoning items carry their text, which is passed back as it is",
    "message.input_image.image_url": "input items are not stored, so never listed",
}
# Input-item fields ("ITEM_TYPE.FIELD", or "PART_TYPE.FIELD" for a content part) that change
# nothing here, accepted and ignored (gateway.openai_api.responses_format reads the items).
RESPONSES_ITEM_NOOP_FIELDS: dict[str, str] = {
    **{f"{kind}.{name}": "an output item's bookkeeping, echoed back in the history"
       for kind in ("message", "function_call", "function_call_output", "reasoning") for name in ("id", "status")
       if f"{kind}.{name}" != "function_call.id"},  # a call's id stands in for a missing call_id
    "input_text.prompt_cache_breakpoint": PART_NOOP_FIELDS["prompt_cache_breakpoint"],
    "input_image.prompt_cache_breakpoint": PART_NOOP_FIELDS["prompt_cache_breakpoint"],
    "input_image.detail": PART_NOOP_FIELDS["image_url.detail"],
    "output_text.annotations": "an earlier answer's citations; its text is what the model reads",
    "output_text.logprobs": "an earlier answer's logprobs; its text is what the model reads",
}
# Input-item fields accepted only with the values listed, else a 400 naming the field and why.
RESPONSES_ITEM_UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "message.phase": ((None, "final_answer"), "commentary turns are not rendered apart from answers here"),
    "input_image.file_id": ((None,), "files are not stored here; send the image as image_url (a URL or data: URL)"),
    "reasoning.encrypted_content": ((None,), "encrypted reasoning cannot be read here; send its text as content"),
    **{f"{kind}.{name}": (allowed, why) for kind in ("function_call", "function_call_output")
       for name, allowed, why in (("caller", (None, {"type": "direct"}), "programmatic tool calling is not served"),
                                  ("namespace", (None, ""), "tool namespaces are not served"))},
    "function_call.async": ((None, False), "a call's output is awaited before the model goes on"),
}


def _field_error(loc: tuple, message: str, value: Any) -> ValidationError:
    return ValidationError.from_exception_data("ResponsesRequest", [InitErrorDetails(
        type=PydanticCustomError("responses_field", message), loc=loc, input=value)])


def _served_fields(data: dict, prefix: str, fields: Any) -> dict:
    """``data`` (an object at ``prefix``: ``""``, ``"tools[]."``) with its ``fields`` and without
    its no-op and defaulted ones; any other field is a 400 naming it."""
    out = {}
    for name, value in data.items():
        path = prefix + name
        if name in fields:
            out[name] = value
        elif path in RESPONSES_UNSUPPORTED:
            allowed, why = RESPONSES_UNSUPPORTED[path]
            if value not in allowed:
                raise _field_error((name,), why, value)
        elif path not in RESPONSES_NOOP_FIELDS:
            raise _field_error((name,), "unknown field; remove it (see the README's API table for what is served)",
                               value)
    return out


class ResponsesTextFormat(BaseModel):
    """``text.format`` of the Responses API."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponsesText(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: ResponsesTextFormat = Field(default_factory=ResponsesTextFormat)
    verbosity: Literal["medium"] | None = None  # the only value that changes nothing here


class ResponsesTool(BaseModel):
    """A function tool, in the Responses API's flat form."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _nothing_dropped(cls, data: Any) -> Any:
        return _served_fields(data, "tools[].", cls.model_fields) if isinstance(data, dict) else data


class ResponsesToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str


class ResponsesReasoning(BaseModel):
    model_config = ConfigDict(extra="forbid")

    effort: Literal[REASONING_EFFORTS] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # a no-op: RESPONSES_NOOP_FIELDS
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    context: Literal["auto"] | None = None  # the template decides which turns' reasoning it renders
    mode: Literal["standard"] | None = None  # one mode here


class ResponsesStreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_obfuscation: bool | None = None  # a no-op: RESPONSES_NOOP_FIELDS


RESPONSES_INCLUDABLE = ("message.output_text.logprobs",)


class ResponsesRequest(BaseModel):
    """OpenAI's ``POST /v1/responses``, stateless: ``input`` (a string or message / function_call /
    function_call_output items), ``instructions``, function ``tools``, ``text.format``, streaming.
    A field that needs stored responses (``store`` true, ``previous_response_id``) or anything else
    not served is a 400 naming it (``RESPONSES_UNSUPPORTED``); ``RESPONSES_NOOP_FIELDS`` are ignored."""

    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: ResponsesText | None = None
    reasoning: ResponsesReasoning | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    include: list[str] | None = None
    # no-ops, as in chat (``NOOP_FIELDS``)
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # vLLM's extensions, as in chat
    seed: int | None = None
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)

    @model_validator(mode="before")
    @classmethod
    def _nothing_dropped(cls, data: Any) -> Any:
        """A field this server would ignore is a 400 naming it: an unknown one, one not served
        unless at its default, a built-in tool (``tools[i].type``), a tool_choice other than
        none / auto / required / a function, an ``include`` value not served; no-ops are dropped."""
        if not isinstance(data, dict):
            return data
        data = _served_fields(data, "", cls.model_fields)
        choice = data.get("tool_choice")
        if isinstance(choice, dict) and choice.get("type") not in (None, "function"):
            kind = choice.get("type")
            why = ('allowed_tools is not served; send only the allowed tools, with tool_choice "auto" or "required"'
                   if kind == "allowed_tools" else f"{kind!r} tools are not served; only function tools are")
            raise _field_error(("tool_choice", "type"), why, choice)
        tools = data.get("tools")
        for i, tool in enumerate(tools if isinstance(tools, list) else ()):  # not a list: its type check says so
            if isinstance(tool, dict) and tool.get("type") not in (None, "function"):
                raise _field_error(("tools", i, "type"), f"{tool.get('type')!r} tools are not served (built-in tools "
                                   "run on the provider's side); only function tools are", tool)
        include = data.get("include")
        if isinstance(include, list):
            for i, name in enumerate(include):
                if not isinstance(name, str):
                    continue  # not a string: the field's own type check names it
                if name not in RESPONSES_INCLUDABLE and name not in RESPONSES_INCLUDE_NOOP:
                    raise _field_error(("include", i), f"{name!r} is not served (only "
                                       f"{', '.join(RESPONSES_INCLUDABLE)}); remove it", name)
            data = {**data, "include": [v for v in include if not (isinstance(v, str) and v in RESPONSES_INCLUDE_NOOP)]}
        return data

    def wants_logprobs(self) -> bool:
        """The message's ``output_text`` carries its tokens' logprobs: asked by ``include`` or by
        ``top_logprobs`` > 0 (alternatives imply the logprobs they go with)."""
        return "message.output_text.logprobs" in (self.include or ()) or bool(self.top_logprobs)
