"""Typed messages between the services: what one service sends another over HTTP.

* the chat message a client writes (``ChatMessage`` and its content parts, ``ToolDef``), read by
  the gateway and, in ``/tokenize``, by the LLM service (``TokenizeRequest``, which the gateway
  forwards); ``ErrorResponse``, OpenAI's error body every service answers with,
* the encoder protocol (``EncodeParams`` in, ``EncodeResult`` + a tensor out),
* the LLM protocol (``GenerateRequest`` in, ``GenerateResponse`` / ``GenerateChunk`` out).

The rest of OpenAI's API (the request and answer bodies only the gateway reads) is in
``gateway.openai_api``; the engine-core messages inside the LLM service are in ``llm_svc.types.messages``.
Embeddings never travel as JSON floats: they travel as safetensors bytes (see ``shared.wire``),
with the typed header of the message stored in the safetensors metadata.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError, ValidationError

from shared.chat_template import check_template_kwargs

Modality = Literal["image", "video", "audio"]
MAX_LOGIT_BIAS = 1024
MAX_TOP_LOGPROBS = 20  # OpenAI's bound
MODALITIES: tuple[str, ...] = ("image", "video", "audio")


# --------------------------------------------------------------------------------------------
# Chat messages and tools as a client writes them (client -> gateway, and gateway -> LLM in
# /tokenize), OpenAI's error body (every service -> its caller)
# --------------------------------------------------------------------------------------------


class Lenient(BaseModel):
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


class ChatMessage(Lenient):
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


class StructuredSpec(BaseModel):
    """A grammar the output must follow: the engine's form of ``response_format`` and
    ``structured_outputs``. ``spec`` is the JSON schema text (``json``), the regex, the EBNF
    grammar, the choices as a JSON list, or xgrammar's structural tag JSON (``structural_tag``:
    set by the LLM service itself for strict tools under tool_choice "auto"); empty for
    ``json_object``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag"]
    spec: str = ""
    any_whitespace: bool | None = None  # JSON whitespace between tokens; None: the server's setting


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
        # the server's own apply_chat_template arguments; a request template is the service's call
        check_template_kwargs(self.chat_template_kwargs, trust_request_template=True)
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


class KVTransferParams(BaseModel):
    """vLLM's ``kv_transfer_params`` on ``/v1/generate``, the fields that have a meaning here
    (docs/disagg.md). ``do_remote_decode`` (to a ``role: prefill`` replica): run the prompt to its
    first token and hand its KV to the decode core at ``remote_host:remote_port``; the answer is
    that token with ``finish_reason`` ``remote_decode`` (or its own reason when it ends the
    request). ``do_remote_prefill`` (to a ``role: decode`` replica): have the replica at
    ``remote_prefill_url`` prefill the prompt first, then continue from its KV."""

    model_config = ConfigDict(extra="forbid")

    do_remote_decode: bool = False
    remote_host: str | None = Field(default=None, min_length=1, max_length=255)
    remote_port: int | None = Field(default=None, ge=1, le=65535)
    do_remote_prefill: bool = False
    remote_prefill_url: str | None = Field(default=None, pattern=r"^https?://[^\s/]+(/[^\s]*)?$", max_length=2048)

    @model_validator(mode="after")
    def _one_side(self) -> "KVTransferParams":
        if self.do_remote_decode == self.do_remote_prefill:
            raise ValueError("kv_transfer_params: set exactly one of do_remote_decode and do_remote_prefill")
        if self.do_remote_decode and (self.remote_host is None or self.remote_port is None):
            raise ValueError("kv_transfer_params: do_remote_decode needs remote_host and remote_port (the decode "
                             "replica's hand-over address)")
        if self.do_remote_prefill and self.remote_prefill_url is None:
            raise ValueError("kv_transfer_params: do_remote_prefill needs remote_prefill_url (the prefill replica)")
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
    kv_transfer_params: KVTransferParams | None = None  # prefill / decode disaggregation (vLLM's name)

    @model_serializer(mode="wrap")
    def _no_transfer_no_bytes(self, handler):
        # every request without a hand-over (nearly all) travels as it did before the field
        out = handler(self)
        if isinstance(out, dict) and out.get("kv_transfer_params", 0) is None:
            del out["kv_transfer_params"]
        return out

    @model_validator(mode="after")
    def _one_prompt(self) -> "GenerateRequest":
        given = [bool(self.messages), self.prompt is not None, self.prompt_ids is not None]
        if sum(given) != 1:
            raise ValueError("send exactly one of messages, prompt or prompt_ids")
        if self.prompt_ids is not None and not self.prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        check_template_kwargs(self.chat_template_kwargs, trust_request_template=True)
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


# remote_decode: a prefill replica's answer to kv_transfer_params.do_remote_decode (its first
# token; the decode replica continues), never an OpenAI finish reason
FinishReason = Literal["stop", "length", "tool_calls", "abort", "remote_decode"]


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
