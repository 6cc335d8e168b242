"""Typed messages between the client, the gateway, the encoder service and the LLM service.

Three groups live here, and nowhere else:

* the OpenAI chat-completions subset the gateway accepts (``ChatCompletionRequest`` ...),
* the encoder protocol (``EncodeParams`` in, ``EncodeResult`` + a tensor out),
* the LLM protocol (``GenerateRequest`` in, ``GenerateResponse`` / ``GenerateChunk`` out),
* the engine-core protocol between the LLM service's HTTP front and its engine-core process
  (``CoreAdd`` / ``CoreAbort`` in, ``CoreReady`` / ``CoreOutputs`` / ``CoreFailed`` out):
  msgspec structs, msgpack-encoded, over ZMQ (a per-token path, so no pydantic here).

Embeddings never travel as JSON floats: they travel as safetensors bytes (see ``shared.wire``),
with the typed header of the message stored in the safetensors metadata.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

import msgspec
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError, ValidationError

Modality = Literal["image", "video", "audio"]
MAX_LOGIT_BIAS = 1024
MAX_TOP_LOGPROBS = 20  # OpenAI's bound
MAX_CHOICES = 16  # n per request
MODALITIES: tuple[str, ...] = ("image", "video", "audio")


# --------------------------------------------------------------------------------------------
# OpenAI chat-completions subset (client -> gateway)
# --------------------------------------------------------------------------------------------


class _Lenient(BaseModel):
    """OpenAI clients send fields we ignore (``name``, ``user``, ...): accept and drop them."""

    model_config = ConfigDict(extra="ignore")


class _Part(BaseModel):
    """A message content part: its fields are checked first (``_check_parts``), this is the backstop."""

    model_config = ConfigDict(extra="forbid")


class TextPart(_Part):
    type: Literal["text"]
    text: str


class ImageURL(_Part):
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high", "original"] | None = None  # a no-op: PART_NOOP_FIELDS


class ImagePart(_Part):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(_Part):
    url: str = Field(min_length=1)


class VideoPart(_Part):
    type: Literal["video_url"]
    video_url: VideoURL


AudioFormat = Literal["wav", "mp3", "flac", "ogg", "opus", "webm", "m4a", "aac"]


class InputAudio(_Part):
    data: str = Field(min_length=1, description="base64-encoded audio bytes")
    format: AudioFormat = Field(default="wav", description="the container of ``data`` (a no-op: PART_NOOP_FIELDS)")


class AudioPart(_Part):
    type: Literal["input_audio"]
    input_audio: InputAudio


ContentPart = Annotated[
    Union[TextPart, ImagePart, VideoPart, AudioPart], Field(discriminator="type")
]

# Content-part fields that change nothing here, accepted and ignored (a path inside the part).
PART_NOOP_FIELDS: dict[str, str] = {
    "image_url.detail": "images are encoded at the model's own resolution (vLLM ignores it too)",
    "input_audio.format": "the container is read from the audio bytes (the value is still checked)",
    "prompt_cache_breakpoint": "a hint for the provider's prompt cache (prefix caching here is automatic)",
}
# The part types served: type -> its fields besides ``type`` (-> the model of a field that is an object)
_PART_FIELDS: dict[str, dict[str, type[BaseModel] | None]] = {
    "text": {"text": None}, "image_url": {"image_url": ImageURL}, "video_url": {"video_url": VideoURL},
    "input_audio": {"input_audio": InputAudio},
}


def _part_error(loc: tuple, message: str, value: Any) -> ValidationError:
    return ValidationError.from_exception_data("ContentPart", [InitErrorDetails(
        type=PydanticCustomError("content_part", message), loc=loc, input=value)])


def _check_parts(role: Any, content: list) -> list:
    """A message's content parts, checked before they are parsed: an unknown part type, or a part
    field this server would ignore, is a 400 naming it (``messages[i].content[j].FIELD``); no-op
    fields are dropped. An assistant's ``refusal`` part is its text, as vLLM reads it."""
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            out.append(part)
            continue
        kind = part.get("type")
        fields = _PART_FIELDS.get(kind) if isinstance(kind, str) else None
        if kind == "refusal" and role == "assistant":
            fields = {"refusal": None}
        if fields is None:
            why = {"refusal": "refusal parts belong to assistant messages",
                   "file": "file parts are not served (send images as image_url, audio as input_audio)",
                   }.get(kind, f"unknown content part type {kind!r}") if isinstance(kind, str) else (
                "a content part's type must be a string")
            served = ", ".join(_PART_FIELDS)
            raise _part_error(("content", j, "type"), f"{why}; this server takes {served} parts", part)
        for name, value in part.items():
            if name == "type" or name in PART_NOOP_FIELDS:
                continue
            if name not in fields:
                raise _part_error(("content", j, name), f"not a field of a {kind} part here; remove it", part)
            nested = fields[name]
            for key in value if nested is not None and isinstance(value, dict) else ():
                if key not in nested.model_fields:
                    raise _part_error(("content", j, name, key), f"not a field of {name} here; remove it", part)
        part = {k: v for k, v in part.items() if k not in PART_NOOP_FIELDS}
        if kind == "refusal":
            if not isinstance(part.get("refusal"), str):
                raise _part_error(("content", j, "refusal"), "a refusal part needs its text as a string", part)
            part = {"type": "text", "text": part["refusal"]}
        out.append(part)
    return out


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class MessageToolCall(BaseModel):
    """An assistant turn's tool call in the history (OpenAI's shape)."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this answers
    reasoning_content: str | None = None  # assistant turns: passed back to templates that render it
    reasoning: str | None = None  # vLLM's name for reasoning_content
    name: str | None = None  # a tool turn's function name (some templates render it); else no-op

    @model_validator(mode="before")
    @classmethod
    def _nothing_dropped(cls, data: Any) -> Any:
        """A message field this server would ignore is a 400 naming it (``name`` changes nothing:
        the chat templates we serve do not render it)."""
        if isinstance(data, dict):
            for key, value in data.items():
                if key in ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "reasoning"):
                    continue
                if key in MESSAGE_LATER and value in (None, [], ""):
                    continue
                raise ValueError(f"{key}: {'not supported by this server yet' if key in MESSAGE_LATER else 'unknown message field'}; remove it")
            if isinstance(data.get("content"), list):
                data = {**data, "content": _check_parts(data.get("role"), data["content"])}
        return data

    @model_validator(mode="after")
    def _roles(self) -> "ChatMessage":
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not {self.role}")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"tool_call_id belongs to tool messages, not {self.role}")
        if (self.reasoning_content or self.reasoning) and self.role != "assistant":
            raise ValueError(f"reasoning_content belongs to assistant messages, not {self.role}")
        return self

    def reasoning_text(self) -> str | None:
        return self.reasoning_content if self.reasoning_content is not None else self.reasoning

    def parts(self) -> list[ContentPart]:
        """The content as a list of parts (a plain string is one text part)."""
        if self.content is None:
            return []
        if isinstance(self.content, str):
            return [TextPart(type="text", text=self.content)]
        return list(self.content)


class StreamOptions(_Lenient):
    include_usage: bool = False


MESSAGE_LATER = ("refusal", "function_call", "audio")


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # the contract's types: no "1" for true

    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None  # tool_choice required / named are enforced either way


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")

# Request fields that change nothing here, accepted and ignored (OpenAI's bookkeeping, and
# switches whose only meaningful value is the default); any other field that is not a field of
# ``ChatCompletionRequest`` is refused with a 400 that names it.
NOOP_FIELDS: dict[str, str] = {
    "user": "an end-user id for the provider's abuse monitoring",
    "metadata": "tags for the provider's stored completions",
    "store": "stored completions: only false (or null) is accepted",
    "service_tier": "the provider's processing tier",
    "safety_identifier": "an end-user id for the provider's abuse monitoring",
    "prompt_cache_key": "a routing hint for the provider's prompt cache (the gateway routes by content)",
}
# Fields of OpenAI's or vLLM's request that are not served yet; each is accepted only with the
# value that changes nothing (``None`` or the listed default), else 400 naming it.
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    # vLLM 0.12+ took these out for ``structured_outputs``; the message says so
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "echo": (None, False),
}


class StructuredSpec(BaseModel):
    """A grammar the output must follow: the engine's form of ``response_format`` and
    ``structured_outputs``. ``spec`` is the JSON schema text (``json``), the regex, the EBNF
    grammar, or the choices as a JSON list; empty for ``json_object``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["json", "json_object", "regex", "choice", "grammar"]
    spec: str = ""
    any_whitespace: bool | None = None  # JSON whitespace between tokens; None: the server's setting


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # enforced either way (vLLM too)


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format: type json_schema needs a json_schema object")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"response_format: json_schema goes with type json_schema, not {self.type}")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of json / regex / choice / grammar / json_object."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = Field(default=None, min_length=1)
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = Field(default=None, min_length=1)
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False  # one grammar engine here: nothing to fall back to
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> "StructuredOutputs":
        given = [k for k in ("json_", "regex", "choice", "grammar", "json_object") if getattr(self, k) is not None]
        if self.structural_tag is not None:
            raise ValueError("structured_outputs.structural_tag: not supported by this server yet; use json, "
                             "regex, choice or grammar")
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern: not supported (the grammar engine here "
                             "takes disable_any_whitespace); remove it")
        if self.disable_additional_properties:
            raise ValueError("structured_outputs.disable_additional_properties: not supported; put "
                             '"additionalProperties": false in the schema instead')
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar, json_object; "
                             f"got {len(given)}")
        if isinstance(self.json_, str):
            try:
                if not isinstance(json.loads(self.json_), dict):
                    raise ValueError
            except ValueError:
                raise ValueError("structured_outputs.json: a JSON schema object (or its JSON text)") from None
        if self.json_object is False:
            raise ValueError("structured_outputs.json_object: only true means something; remove it")
        return self

    def spec(self) -> StructuredSpec:
        ws = False if self.disable_any_whitespace else None
        if self.json_ is not None:
            text = self.json_ if isinstance(self.json_, str) else json.dumps(self.json_)
            return StructuredSpec(kind="json", spec=text, any_whitespace=ws)
        if self.regex is not None:
            return StructuredSpec(kind="regex", spec=self.regex, any_whitespace=ws)
        if self.choice is not None:
            return StructuredSpec(kind="choice", spec=json.dumps(self.choice), any_whitespace=ws)
        if self.grammar is not None:
            return StructuredSpec(kind="grammar", spec=self.grammar, any_whitespace=ws)
        return StructuredSpec(kind="json_object", any_whitespace=ws)


class GenerationFields(_Lenient):
    """The sampling fields chat and text completions share, and the rule that no field is dropped."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)  # choices; the prompt is computed once
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's form) -> bias in [-100, 100]
    # vLLM extensions that benchmark clients (aiperf, guidellm) send to hold output lengths
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    # vLLM's priority: lower values are admitted first (ties keep the scheduler's own order)
    priority: int = Field(default=0, ge=-(2**31), lt=2**31)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's: each prompt token's logprob and this many alternatives (``prompt_logprobs`` of the answer)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="before")
    @classmethod
    def _nothing_dropped(cls, data: Any) -> Any:
        """Refuse a field that would be silently ignored (see ``NOOP_FIELDS``, ``UNSUPPORTED_FIELDS``)."""
        if not isinstance(data, dict):
            return data
        for name, value in data.items():
            if name in cls.model_fields or name in NOOP_FIELDS:
                if name == "store" and value not in (None, False):
                    raise ValueError("store: stored completions are not kept by this server; send store=false or omit it")
                continue
            allowed = UNSUPPORTED_FIELDS.get(name)
            if allowed is None:
                raise ValueError(f"{name}: unknown request field; remove it (see the README's API table for "
                                 "what is served)")
            if value not in allowed:
                if name.startswith("guided_"):
                    raise ValueError(f"{name}: send structured_outputs={{\"{name[7:]}\": ...}} instead (vLLM's "
                                     "current form)")
                raise ValueError(f"{name}: not supported by this server yet; remove it")
        return data

    def structured_spec(self) -> "StructuredSpec | None":
        """The grammar ``response_format`` or ``structured_outputs`` asks for (never both:
        ``_one_constraint``), or None."""
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            return StructuredSpec(kind="json_object")
        if rf is not None and rf.type == "json_schema":
            return StructuredSpec(kind="json", spec=json.dumps(rf.json_schema.schema_))
        so = self.structured_outputs
        return so.spec() if so is not None else None

    @field_validator("logit_bias")
    @classmethod
    def _bias_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return None
        for k, b in v.items():
            if not k.strip().lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {k!r}")
            if not -100.0 <= b <= 100.0:
                raise ValueError(f"logit_bias[{k}] = {b}: biases must be in [-100, 100]")
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(v)}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are supported")
        return [s for s in stops if s]

    def output_cap(self) -> int | None:
        return self.max_tokens

    def prompt_logprobs_wanted(self) -> int | None:
        """Alternatives per prompt position the answer carries, or None (not asked, or streamed:
        a stream has no place for them)."""
        return None if self.stream else self.prompt_logprobs

    def effective_max_tokens(self, default: int) -> int:
        """The request's cap, or ``default`` (raised to ``min_tokens`` when that asks for more)."""
        return self.output_cap() or max(default, self.min_tokens)

    @model_validator(mode="after")
    def _one_constraint(self) -> "GenerationFields":
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise ValueError("send one of response_format and structured_outputs, not both (one would be ignored)")
        return self

    @model_validator(mode="after")
    def _min_le_max(self) -> "GenerationFields":
        cap = self.output_cap()
        if cap is not None and self.min_tokens > cap:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({cap})")
        return self

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self) -> "GenerationFields":
        if self.stream and self.prompt_logprobs:  # vLLM's rule: a stream has no place for them
            raise ValueError("prompt_logprobs: not available when stream=true; send the request unstreamed")
        return self


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: true (OpenAI's default)
    # rendered by the chat template (vLLM's): e.g. MiMo's enable_thinking
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal[REASONING_EFFORTS] | None = None  # gpt-oss's template renders it
    include_reasoning: bool = True  # vLLM's: false drops the reasoning from the answer

    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: "auto" with tools, "none" without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @model_validator(mode="after")
    def _tools_consistent(self) -> "ChatCompletionRequest":
        choice = self.tool_choice
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        if choice == "required" and not names:
            raise ValueError('tool_choice "required" needs tools')
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names function {choice.function.name!r}, which is not in tools")
        forced = choice == "required" or isinstance(choice, NamedToolChoice)
        if forced and (self.response_format is not None and self.response_format.type != "text"
                       or self.structured_outputs is not None):
            raise ValueError("tool_choice required or a named function already constrains the output; drop "
                             "response_format / structured_outputs")
        if self.chat_template_kwargs:
            reserved = {"messages", "tools", "add_generation_prompt", "tokenize", "chat_template", "documents"}
            bad = sorted(reserved & set(self.chat_template_kwargs))
            if bad:
                raise ValueError(f"chat_template_kwargs: {bad[0]} is set by the server; remove it")
        return self

    def output_cap(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self


# --- /v1/responses: every field of OpenAI's request is honoured, a no-op, or a 400 naming it ----
# (tests/unit/test_responses_fields.py walks the ``openai`` client's Responses types)

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
# nothing here, accepted and ignored (gateway.responses_format reads the items).
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
        for i, tool in enumerate(data.get("tools") or ()):
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


COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions


class CompletionRequest(GenerationFields):
    """OpenAI's legacy ``/v1/completions``: a prompt string or token ids (or a batch of either:
    one choice each, not streamed), ``logprobs`` = how many alternatives per token, ``echo``.
    With ``echo`` and ``logprobs`` the logprobs cover the prompt's tokens too (the first one's is
    null: vLLM's ``prompt_logprobs``), and ``max_tokens=0`` answers the prompt alone (vLLM's; what
    lm-evaluation-harness sends for loglikelihoods)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=1)

    def output_cap(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else max(COMPLETION_DEFAULT_MAX_TOKENS, self.min_tokens)

    def effective_max_tokens(self, default: int) -> int:
        return self.output_cap()  # never None here; 0 stays 0

    def prompt_logprobs_wanted(self) -> int | None:
        """Alternatives per prompt position the answer needs, or None: ``prompt_logprobs``, and
        with ``echo`` and ``logprobs`` the echoed prompt's (streamed too: they lead the stream)."""
        echoed = self.logprobs if self.echo else None
        own = super().prompt_logprobs_wanted()
        return echoed if own is None else own if echoed is None else max(own, echoed)

    def prompt_logprobs_field(self) -> int | None:
        """Alternatives per position of the answer's vLLM ``prompt_logprobs`` field (None: no
        field): vLLM's rule, ``prompt_logprobs`` or else ``logprobs`` when echoed."""
        if self.stream:
            return None
        return self.prompt_logprobs if self.prompt_logprobs is not None else self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        """The batch: each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)):
            return [p]
        return list(p)

    @model_validator(mode="after")
    def _servable(self) -> "CompletionRequest":
        prompts = self.prompts()
        if not prompts or any(isinstance(p, list) and not p for p in prompts) or prompts == [""]:
            raise ValueError("prompt must not be empty")
        if self.suffix:
            raise ValueError("suffix: not supported by this server (no model here is trained for insertion); remove it")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 answers the prompt alone: it needs echo=true")
        if self.stream and len(prompts) > 1:
            raise ValueError("prompt: send one prompt per streamed request (a batch is answered whole)")
        return self


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize``: a ``prompt`` string, or chat ``messages`` rendered by the
    model's template (text parts only)."""

    model_config = ConfigDict(extra="forbid", strict=True)  # no "1" for 1: the contract says integers

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDef] | None = None  # rendered by the chat template, as in a chat request
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (vLLM's)
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt or messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # no "1" for 1: the contract says integers

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None
    # the model's reasoning under both names clients read: vLLM's ``reasoning`` and DeepSeek's
    # ``reasoning_content`` (what OpenAI-compatible SDKs and LangChain look for)
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler):
        """Plain answers keep OpenAI's plain shape: no null tool_calls or reasoning keys."""
        data = handler(self)
        for k in ("tool_calls", "reasoning", "reasoning_content"):
            if data.get(k) is None:
                data.pop(k, None)
        return data


# OpenAI's values; an aborted generation is an error for the client, never a finish reason
OpenAIFinishReason = Literal["stop", "length", "tool_calls"]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None  # the token's UTF-8 bytes


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: OpenAIFinishReason | None
    logprobs: ChoiceLogprobs | None = None


class RankedLogprob(BaseModel):
    """vLLM's ``Logprob``: a token's logprob, its rank in the vocabulary (1: the most likely) and
    its text; ``prompt_logprobs`` maps token ids to these."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's ``prompt_logprobs`` of an answer: per prompt position (None for the first) the prompt
# token and the asked-for most likely alternatives, by token id
PromptLogprobs = list[dict[int, RankedLogprob] | None]


def _omit_none(data: dict, *keys: str) -> dict:
    for k in keys:
        if data.get(k) is None:
            data.pop(k, None)
    return data


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, when asked (one list: the prompt is shared)

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler):
        return _omit_none(handler(self), "prompt_logprobs")


class CompletionLogprobs(BaseModel):
    """The legacy shape; with ``echo`` the prompt's tokens lead, the first with null logprobs."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: OpenAIFinishReason | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, when computed

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler):
        return _omit_none(handler(self), "prompt_logprobs")


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: OpenAIFinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "mmserve"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``."""

    error: ErrorDetail


# --------------------------------------------------------------------------------------------
# Encoder protocol (gateway -> encoder):  POST /v1/encode?modality=...  body = raw media bytes
# Response: safetensors bytes with one tensor "embeds" [num_tokens, hidden] (float32 or bf16)
# and the EncodeResult in its metadata.
# --------------------------------------------------------------------------------------------


class EncodeParams(BaseModel):
    """Query parameters of ``POST /v1/encode``; the body is the raw media bytes."""

    model_config = ConfigDict(extra="forbid")

    modality: Modality
    content_hash: str | None = Field(
        default=None, description="shared.hashing.content_hash of the body; computed if absent"
    )
    fps: float | None = Field(default=None, gt=0, description="video: frames sampled per second")
    max_frames: int | None = Field(default=None, ge=1, le=4096, description="video: frame cap")
    by_ref: bool = Field(
        default=False, description="answer the header only (JSON EncodeResult with by_ref=true) and keep the "
        "embeddings for GET /v1/embeddings/{key}; an encoder that cannot keep them answers by value"
    )


class MediaSegment(BaseModel):
    """One run of an item's embedding rows that the prompt writes on its own (MiMo-V2.5 video:
    one temporal group, preceded by its ``MM:SS`` timestamp text)."""

    start_s: float = Field(ge=0.0, description="time of the run's first frame in the media, seconds")
    num_tokens: int = Field(ge=1)


def _check_segments(segments: list[MediaSegment] | None, num_tokens: int) -> None:
    if segments is not None and sum(g.num_tokens for g in segments) != num_tokens:
        raise ValueError("segments must cover num_tokens rows exactly")


# Messages parsed from JSON once per request or per streamed chunk: pydantic's JSON string cache
# (process-wide, 16,384 entries) would fill with their values (request ids, text deltas, content
# hashes: unique by design), ~1.6 MB per process that stops growing only once the cache is full
# (the soak's "unexplained" gateway growth). Keys repeat and stay cached.
WIRE_JSON = ConfigDict(cache_strings="keys")


class EncodeResult(BaseModel):
    """Header of an encoder response (the tensor travels beside it, never as JSON)."""

    model_config = WIRE_JSON

    modality: Modality
    content_hash: str
    model: str
    num_tokens: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    cached: bool = False
    encode_ms: float = 0.0
    key: str | None = Field(default=None, description="shared.hashing.media_key of the item on this encoder")
    by_ref: bool = Field(
        default=False, description="no tensor in this response: GET /v1/embeddings/{key} serves it"
    )
    segments: list[MediaSegment] | None = Field(
        default=None, description="rows split into timestamped runs (sum == num_tokens); None: one run")

    @model_validator(mode="after")
    def _segments_cover_rows(self) -> "EncodeResult":
        _check_segments(self.segments, self.num_tokens)
        return self


# --------------------------------------------------------------------------------------------
# LLM protocol (gateway -> llm):  POST /v1/generate
# Body: safetensors bytes; tensors "mm.{i}" [num_tokens_i, hidden] hold the i-th media item's
# embeddings (by value), the GenerateRequest travels as JSON in the metadata key "request".
# By reference an item has no tensor: its PromptMedia names key + sources, and the LLM fetches
# only what its prefix cache misses. A fetch that finds nothing (evicted) fails the request with
# 409 ``code="media_unavailable"``; the gateway then re-sends the request by value.
# Response: GenerateResponse JSON, or (stream=true) NDJSON lines of GenerateChunk.
# --------------------------------------------------------------------------------------------


class PromptText(BaseModel):
    type: Literal["text"] = "text"
    text: str


class PromptMedia(BaseModel):
    """A media item in the prompt: its embeddings are tensor ``mm.{index}`` of the body, or, by
    reference (no such tensor, ``sources`` set), fetched by ``key`` from
    ``{source}/v1/embeddings/{key}`` by the LLM when its prefix cache does not cover the span."""

    type: Literal["media"] = "media"
    modality: Modality
    index: int = Field(ge=0)
    content_hash: str
    num_tokens: int = Field(ge=1)
    key: str | None = Field(default=None, description="media_key (content + encoder model + preprocessing)")
    segments: list[MediaSegment] | None = Field(
        default=None, description="EncodeResult.segments of the item (timestamped runs), if the encoder gave them")
    sources: list[str] = Field(
        default_factory=list, max_length=8,
        description="encoder base URLs that serve the embeddings by key, tried in order (by reference)",
    )

    @model_validator(mode="after")
    def _ref_has_key(self) -> "PromptMedia":
        if self.sources and not self.key:
            raise ValueError("a media part with sources (by reference) needs its key")
        for url in self.sources:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"media source {url!r} must be an http(s) base URL")
        return self

    @model_validator(mode="after")
    def _segments_cover_rows(self) -> "PromptMedia":
        _check_segments(self.segments, self.num_tokens)
        return self


PromptPart = Annotated[Union[PromptText, PromptMedia], Field(discriminator="type")]


class PromptMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: list[PromptPart]
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    name: str | None = None

    @classmethod
    def of(cls, msg: ChatMessage, content: list[PromptPart]) -> "PromptMessage":
        """A client's message with its content already converted (text and media parts)."""
        return cls(role=msg.role, content=content, tool_calls=msg.tool_calls, tool_call_id=msg.tool_call_id,
                   reasoning_content=msg.reasoning_text(), name=msg.name if msg.role == "tool" else None)


class ToolSpec(BaseModel):
    """What the LLM needs of a request's tools: the definitions (rendered by the chat template),
    the choice (``"none"`` / ``"auto"`` / ``"required"`` / a function name) and whether calls may
    come several at a time."""

    model_config = ConfigDict(extra="forbid")

    tools: list[ToolDef] = Field(default_factory=list)
    choice: str = "auto"  # "none" | "auto" | "required" | "function:<name>"
    parallel: bool = True


class SamplingParams(BaseModel):
    """Sampling knobs; ``temperature == 0`` means greedy."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(default=64, ge=0, description="0: the prompt alone, no token generated (echo)")
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    # no EOS, stop token or stop string ends the request before this many output tokens
    # (vLLM's semantics: EOS and stop tokens are masked out of the logits until then)
    min_tokens: int = Field(default=0, ge=0)
    priority: int = Field(default=0, ge=-(2**31), lt=2**31, description="lower is admitted first")
    # OpenAI's penalties over the output so far; vLLM's repetition_penalty over prompt + output
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    logit_bias: dict[int, float] = Field(default_factory=dict, description="token id -> bias in [-100, 100]")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="keep tokens with p >= min_p * p_max")
    structured: StructuredSpec | None = None
    # vLLM's: the logprob of every prompt token given the ones before it, with this many
    # alternatives; such a request takes no prefix-cache hit (a cached prefix has no logits)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _min_le_max(self) -> "SamplingParams":
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        bad = [t for t, b in self.logit_bias.items() if not -100.0 <= b <= 100.0]
        if bad:
            raise ValueError(f"logit_bias values must be in [-100, 100] (token ids {bad[:5]})")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        return self


class GenerateRequest(BaseModel):
    """One generation: chat ``messages`` (rendered by the model's template), or a raw ``prompt``
    string (tokenized with the tokenizer's special tokens, as vLLM's completions) or token ids."""

    model_config = WIRE_JSON

    request_id: str = Field(min_length=1)
    messages: list[PromptMessage] = Field(default_factory=list)
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    stream: bool = False
    return_logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)  # alternatives per token (with return_logprobs)
    echo: bool = False  # the answer's text starts with the prompt's (completions)
    tools: ToolSpec | None = None
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    include_reasoning: bool = True

    @model_validator(mode="after")
    def _one_prompt(self) -> "GenerateRequest":
        given = [bool(self.messages), self.prompt is not None, self.prompt_ids is not None]
        if sum(given) != 1:
            raise ValueError("send exactly one of messages, prompt or prompt_ids")
        if self.prompt_ids is not None and not self.prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        return self

    @model_validator(mode="after")
    def _media_indices_dense(self) -> "GenerateRequest":
        idx = sorted(
            p.index for m in self.messages for p in m.content if isinstance(p, PromptMedia)
        )
        if idx != list(range(len(idx))):
            raise ValueError(f"media indices must be 0..n-1 without gaps, got {idx}")
        return self

    def media(self) -> list[PromptMedia]:
        items = [p for m in self.messages for p in m.content if isinstance(p, PromptMedia)]
        return sorted(items, key=lambda p: p.index)


FinishReason = Literal["stop", "length", "tool_calls", "abort"]


class TokenLogprob(BaseModel):
    """A token, its text alone and its log-probability under the raw model."""

    model_config = WIRE_JSON

    token_id: int
    token: str
    logprob: float


class SampledLogprob(TokenLogprob):
    """A generated token's logprob and its ``top_logprobs`` most likely alternatives."""

    top: list[TokenLogprob] = Field(default_factory=list)


class PromptTokenLogprob(BaseModel):
    """A prompt token's log-probability given the tokens before it (None for the first token,
    which has none), its rank in the vocabulary (1: the most likely; ties count against it) and
    its position's ``prompt_logprobs`` most likely alternatives, under the raw model."""

    model_config = WIRE_JSON

    token_id: int
    token: str
    logprob: float | None = None
    rank: int | None = None
    top: list[TokenLogprob] = Field(default_factory=list)


class ToolCallWire(BaseModel):
    """A parsed tool call (whole, in a response) or a piece of one (in a stream chunk: ``id`` and
    ``name`` on its first piece only; the ``arguments`` pieces of one ``index`` concatenate)."""

    model_config = WIRE_JSON

    index: int = Field(ge=0)
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class GenerateResponse(BaseModel):
    model_config = WIRE_JSON

    request_id: str
    text: str
    reasoning: str | None = None
    tool_calls: list[ToolCallWire] | None = None
    token_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    logprobs: list[float] | None = None
    token_logprobs: list[SampledLogprob] | None = None  # one per token_ids entry, if asked
    prompt_logprobs: list[PromptTokenLogprob] | None = None  # one per prompt token, if asked


class GenerateChunk(BaseModel):
    """One line of a streamed generation; the last one has ``finish_reason`` set and counts."""

    model_config = WIRE_JSON

    request_id: str
    text: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCallWire] | None = None
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: FinishReason | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None
    token_logprobs: list[SampledLogprob] | None = None  # one per token_ids entry, if asked
    prompt_logprobs: list[PromptTokenLogprob] | None = None  # one per prompt token, if asked: on one chunk


class ServiceLimits(BaseModel):
    """What an LLM replica can take, so the gateway refuses what cannot fit before sending it."""

    max_model_len: int = Field(ge=1)
    max_token_bytes: int = Field(ge=1, description="longest token in UTF-8 bytes: tokens >= bytes / this")
    # the replica's length bucket: prompts of [min_prompt_tokens, max_prompt_tokens) are routed here
    min_prompt_tokens: int = Field(default=0, ge=0)
    max_prompt_tokens: int | None = Field(default=None, ge=1)


class HealthStatus(BaseModel):
    status: Literal["ok", "loading", "error"]
    service: str
    model: str | None = None
    detail: str | None = None
    limits: ServiceLimits | None = None
    speculative_config: dict | None = None  # LLM: the speculative decoding in force (vLLM's JSON keys)
    kv_instance: str | None = Field(
        default=None, description="LLM replicas publishing KV events: the id their events carry")


# --------------------------------------------------------------------------------------------
# Engine-core protocol (LLM front <-> engine-core process, msgpack over ZMQ)
#
# Every message carries the ``epoch`` of the core process it is for / from: the front starts
# epoch 1, 2, ... on each (re)start and drops anything of an older one, and a core drops input
# of another epoch, so nothing of a crashed core leaks into its successor.
# --------------------------------------------------------------------------------------------


class CoreTensor(msgspec.Struct, frozen=True):
    """A tensor as raw bytes (row-major): ``dtype`` is a torch dtype name, e.g. ``"float32"``."""

    dtype: str
    shape: list[int]
    data: bytes


class CoreSampling(msgspec.Struct, frozen=True):
    """``SamplingParams`` as the core needs it (already validated by the front)."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    priority: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    min_p: float = 0.0
    structured: tuple[str, str, bool | None] | None = None  # StructuredSpec's (kind, spec, any_whitespace)
    prompt_logprobs: int | None = None


class CoreAdd(msgspec.Struct, tag="add"):
    """Start a request: the tokenized prompt with its media embeddings and spans."""

    epoch: int
    request_id: str
    prompt_ids: list[int]
    sampling: CoreSampling
    mm_items: list[CoreTensor | None] = []  # None: by reference, sent later in a CoreMedia
    mm_spans: list[tuple[int, int, int]] = []  # (start_position, length, item_index)
    mm_hashes: list[str] = []
    bidirectional: bool = False
    return_logprobs: bool = False
    swa_checkpoints: list[int] = []  # prompt positions whose SWA windows the prefix cache keeps
    top_logprobs: int = 0
    router_keys: list[tuple[int, int]] = []  # (router block key, prompt tokens it needs): KV events


class CoreAbort(msgspec.Struct, tag="abort"):
    """Stop requests and free what they hold (unknown ids are ignored)."""

    epoch: int
    request_ids: list[str]


class CoreShutdown(msgspec.Struct, tag="shutdown"):
    epoch: int


class CoreMedia(msgspec.Struct, tag="media"):
    """Embeddings a ``CoreNeed`` asked for: ``(item_index, tensor)`` pairs of one request."""

    epoch: int
    request_id: str
    items: list[tuple[int, CoreTensor]]


CoreInput = Union[CoreAdd, CoreAbort, CoreShutdown, CoreMedia]


class CorePromptLogprob(msgspec.Struct, array_like=True):
    """A prompt position's logprob (``PromptTokenLogprob`` without the texts, which the front
    adds): None for position 0; ``top``: (token id, logprob) of its most likely alternatives."""

    logprob: float | None = None
    rank: int | None = None
    top: list[tuple[int, float]] = []


class CoreToken(msgspec.Struct, array_like=True):
    """One step's result for one request: a sampled token (or none, for a finish without one)
    and, on the last, ``finish_reason``; ``error`` (with ``status``, 4xx or 5xx) fails it.
    ``prompt_logprobs`` (one per prompt position) rides on the request's first output."""

    request_id: str
    token_id: int | None = None
    logprob: float | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_cached_tokens: int = 0
    error: str | None = None
    status: int = 0
    top: list[tuple[int, float]] | None = None  # (token id, logprob) of the top_logprobs alternatives
    prompt_logprobs: list[CorePromptLogprob] | None = None
    code: str | None = None  # with ``error``: its machine-readable code (e.g. ``context_length_exceeded``)


class CoreStats(msgspec.Struct):
    running: int = 0
    waiting: int = 0
    kv_full_usage: float = 0.0
    kv_swa_usage: float = 0.0
    prefix_hit_tokens: int = 0
    steps: int = 0
    tiers: dict[str, float] = {}  # KV tier counters (llm_svc.offload.tiers.KVTiers.metrics)


class CoreNeed(msgspec.Struct, array_like=True):
    """A request's admission found media spans past its cached prefix whose embeddings it was
    sent by reference: the front fetches ``items`` (item indices) and answers a ``CoreMedia``."""

    request_id: str
    items: list[int]


class CoreOutputs(msgspec.Struct, tag="outputs"):
    """What one loop iteration of the core produced; also its heartbeat (``outputs`` may be
    empty). ``stats`` rides along at most a few times a second."""

    epoch: int
    outputs: list[CoreToken] = []
    stats: CoreStats | None = None
    needs: list[CoreNeed] = []
    # KV events: router block keys the prefix tree now holds / no longer holds
    kv_stored: list[int] = []
    kv_removed: list[int] = []


class CoreReady(msgspec.Struct, tag="ready"):
    """The core loaded the model and serves; capacities let the front refuse what never fits."""

    epoch: int
    pid: int
    num_full_slots: int
    num_swa_slots: int
    window: int
    kv_bytes: int


class CoreFailed(msgspec.Struct, tag="failed"):
    """The core could not start (e.g. the model does not load); it exits after sending this."""

    epoch: int
    error: str


CoreOutput = Union[CoreOutputs, CoreReady, CoreFailed]
