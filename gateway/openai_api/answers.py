"""The bodies the gateway answers with (gateway -> client), OpenAI's shapes with vLLM's
additions: chat completions and their stream chunks, text completions, the model list."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_serializer

from shared.schemas import FunctionCall


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
