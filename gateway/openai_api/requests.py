"""OpenAI's ``/v1/chat/completions`` and ``/v1/completions`` request bodies (client -> gateway),
with vLLM's extensions: every field is served, a no-op (``NOOP_FIELDS``), or a 400 naming it
(``UNSUPPORTED_FIELDS``, an unknown field)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared.chat_template import check_template_kwargs
from shared.schemas import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, ChatMessage, Lenient, StructuredSpec, ToolDef

MAX_CHOICES = 16  # n per request


class StreamOptions(Lenient):
    include_usage: bool = False


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


class GenerationFields(Lenient):
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
        formatted = (self.response_format is not None and self.response_format.type != "text"
                     or self.structured_outputs is not None)
        if forced and formatted:
            raise ValueError("tool_choice required or a named function already constrains the output; drop "
                             "response_format / structured_outputs")
        strict = [t.function.name for t in self.tools or () if t.function.strict]
        if formatted and strict and self.effective_tool_choice() == "auto":
            raise ValueError(f"tools: function {strict[0]!r} is strict under tool_choice \"auto\", which constrains "
                             "the output to the model's tool-call format; that can not be combined with "
                             "response_format / structured_outputs (text.format in /v1/responses): drop strict, "
                             "or the response format")
        # a request template (chat_template) is checked against the gateway's setting in the route
        check_template_kwargs(self.chat_template_kwargs, trust_request_template=True)
        return self

    def output_cap(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self


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
