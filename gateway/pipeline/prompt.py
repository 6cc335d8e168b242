"""From an OpenAI chat request plus encoded media to the LLM's ``GenerateRequest`` and its
safetensors body: an item by value is tensor ``mm.{i}``; by reference it has no tensor, its
``PromptMedia`` names the key and the encoders that serve it (the body is the header alone)."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.openai_api.requests import ChatCompletionRequest, GenerationFields, NamedToolChoice
from gateway.upstream import Encoded
from shared.schemas import (
    GenerateRequest,
    ToolSpec,
    PromptMedia,
    PromptMessage,
    PromptPart,
    PromptText,
    SamplingParams,
    TextPart,
)
from shared.rawwire import RawTensor, pack_raw


def sampling_params(req: GenerationFields, default_max_tokens: int) -> SamplingParams:
    """OpenAI knobs (chat or text completions) -> SamplingParams; unset knobs keep the LLM defaults (greedy)."""
    kw: dict = {"max_tokens": req.effective_max_tokens(default_max_tokens), "stop": req.stop or [],
                "ignore_eos": req.ignore_eos, "min_tokens": req.min_tokens, "priority": req.priority}
    if req.temperature is not None:
        kw["temperature"] = req.temperature
    if req.top_p is not None:
        kw["top_p"] = req.top_p
    if req.top_k is not None:
        kw["top_k"] = req.top_k
    if req.seed is not None:
        kw["seed"] = req.seed
    for name in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "stop_token_ids"):
        if getattr(req, name) is not None:
            kw[name] = getattr(req, name)
    if req.logit_bias:
        kw["logit_bias"] = {int(k): v for k, v in req.logit_bias.items()}
    kw["structured"] = req.structured_spec()
    kw["prompt_logprobs"] = req.prompt_logprobs_wanted()
    return SamplingParams(**kw)


def build_generate_request(
    req: ChatCompletionRequest,
    encoded: Sequence[Encoded],
    request_id: str,
    default_max_tokens: int,
) -> GenerateRequest:
    """Text parts stay text; the i-th media part becomes ``PromptMedia(index=i)``."""
    media = iter(encoded)
    messages: list[PromptMessage] = []
    for msg in req.messages:
        parts: list[PromptPart] = []
        for part in msg.parts():
            if isinstance(part, TextPart):
                parts.append(PromptText(text=part.text))
                continue
            e = next(media)
            parts.append(
                PromptMedia(
                    modality=e.item.modality,
                    index=e.item.index,
                    content_hash=e.item.content_hash,
                    num_tokens=e.num_tokens,
                    key=e.result.key,
                    segments=e.result.segments,  # MiMo video: timestamped runs of the rows
                    sources=list(e.sources) if e.by_ref else [],
                )
            )
        messages.append(PromptMessage.of(msg, parts))
    if next(media, None) is not None:
        raise ValueError("more encoded items than media parts")
    return GenerateRequest(
        request_id=request_id,
        messages=messages,
        sampling=sampling_params(req, default_max_tokens),
        stream=req.stream,
        return_logprobs=req.logprobs,
        top_logprobs=req.top_logprobs or 0,
        tools=tool_spec(req),
        chat_template_kwargs={**(req.chat_template_kwargs or {}),
                              **({"reasoning_effort": req.reasoning_effort} if req.reasoning_effort else {})},
        include_reasoning=req.include_reasoning,
    )


def tool_spec(req: ChatCompletionRequest) -> ToolSpec | None:
    """The request's tools and choice for the LLM (None: no tools)."""
    if not req.tools:
        return None
    choice = req.effective_tool_choice()
    if isinstance(choice, NamedToolChoice):
        choice = f"function:{choice.function.name}"
    return ToolSpec(tools=req.tools, choice=choice, parallel=req.parallel_tool_calls is not False)


def pack_generate(gen: GenerateRequest, encoded: Sequence[Encoded]) -> bytes:
    """The wire body of ``POST /v1/generate``: the items sent by value as tensors (a repeated
    item is written once per index, as the LLM expects), the rest by reference."""
    tensors: dict[str, RawTensor] = {f"mm.{e.item.index}": e.embeds for e in encoded if e.embeds is not None}
    return pack_raw(tensors, gen)
