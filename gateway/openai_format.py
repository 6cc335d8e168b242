"""OpenAI response bodies: ``ChatCompletion`` from a GenerateResponse, and the SSE events of a
stream (role chunk, content deltas, finish chunk, optional usage chunk, ``[DONE]``)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from shared.schemas import (
    AssistantMessage,
    ChatCompletion,
    ChatTokenLogprob,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    SampledLogprob,
    TopLogprob,
    ChatCompletionChunk,
    Choice,
    ChunkChoice,
    DeltaMessage,
    FinishReason,
    GenerateResponse,
    PromptTokensDetails,
    Usage,
)

SSE_DONE = b"data: [DONE]\n\n"


def completion_id(prefix: str = "chatcmpl") -> str:
    """OpenAI's id forms: ``chatcmpl-...`` (chat), ``cmpl-...`` (text completions)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def choice_logprobs(entries: list[SampledLogprob] | None) -> ChoiceLogprobs | None:
    """Our per-token logprobs in OpenAI's ``choices[].logprobs`` form (None: not asked)."""
    if entries is None:
        return None

    def top(t) -> TopLogprob:
        return TopLogprob(token=t.token, logprob=t.logprob, bytes=list(t.token.encode("utf-8")))

    return ChoiceLogprobs(content=[ChatTokenLogprob(**top(e).model_dump(), top_logprobs=[top(a) for a in e.top])
                                   for e in entries])


def chat_completion(resp: GenerateResponse, model: str, cid: str, created: int) -> ChatCompletion:
    choice = Choice(message=AssistantMessage(content=resp.text), finish_reason=resp.finish_reason,
                    logprobs=choice_logprobs(resp.token_logprobs))
    return ChatCompletion(
        id=cid,
        created=created,
        model=model,
        choices=[choice],
        usage=usage(resp.prompt_tokens, resp.completion_tokens, resp.cached_tokens),
    )


def sse_error(message: str, type: str = "upstream_error") -> bytes:
    """The ``error`` event of a stream that failed after its headers were sent."""
    return sse({"error": {"message": message, "type": type, "param": None, "code": None}})


def completion_logprobs(entries: list[SampledLogprob] | None, offset: int = 0) -> CompletionLogprobs | None:
    """Our per-token logprobs in the legacy completions form; ``offset``: characters before the
    first token in the choice's text."""
    if entries is None:
        return None
    out = CompletionLogprobs()
    for e in entries:
        out.tokens.append(e.token)
        out.token_logprobs.append(e.logprob)
        out.top_logprobs.append({a.token: a.logprob for a in e.top})
        out.text_offset.append(offset)
        offset += len(e.token)
    return out


def text_completion(resps: list[GenerateResponse], model: str, cid: str, created: int, logprobs: bool) -> Completion:
    """One choice per prompt of the batch, usage summed over them."""
    choices = [CompletionChoice(index=i, text=r.text, finish_reason=r.finish_reason,
                                logprobs=completion_logprobs(r.token_logprobs if logprobs else None))
               for i, r in enumerate(resps)]
    u = usage(sum(r.prompt_tokens for r in resps), sum(r.completion_tokens for r in resps),
              sum(r.cached_tokens for r in resps))
    return Completion(id=cid, created=created, model=model, choices=choices, usage=u)


class CompletionChunkWriter:
    """The SSE events of one streamed text completion (one prompt)."""

    def __init__(self, cid: str, created: int, model: str, include_usage: bool, logprobs: bool) -> None:
        self.cid, self.created, self.model = cid, created, model
        self.include_usage, self.logprobs = include_usage, logprobs
        self._offset = 0

    def _event(self, choices: list[CompletionChoice], u: Usage | None = None) -> bytes:
        body = Completion(id=self.cid, created=self.created, model=self.model, choices=choices, usage=u).model_dump()
        if not self.include_usage:
            body.pop("usage")
        return sse(body)

    def opening(self) -> list[bytes]:
        return []

    def content(self, text: str, entries: list[SampledLogprob] | None = None) -> bytes:
        lp = completion_logprobs(entries, self._offset) if self.logprobs and entries is not None else None
        self._offset += sum(len(e.token) for e in entries or ())
        return self._event([CompletionChoice(text=text, logprobs=lp)])

    def finish(self, reason: FinishReason) -> bytes:
        return self._event([CompletionChoice(text="", finish_reason=reason)])

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> bytes:
        return self._event([], usage(prompt_tokens, completion_tokens, cached_tokens))

    error = staticmethod(sse_error)  # the same ``error`` event as chat


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class ChunkWriter:
    """Builds the SSE events of one streamed completion."""

    def __init__(self, cid: str, created: int, model: str, include_usage: bool) -> None:
        self.cid, self.created, self.model = cid, created, model
        self.include_usage = include_usage

    def _chunk(self, choices: list[ChunkChoice], u: Usage | None = None) -> bytes:
        body = ChatCompletionChunk(
            id=self.cid, created=self.created, model=self.model, choices=choices, usage=u
        ).model_dump()
        for c in body["choices"]:
            c["delta"] = {k: v for k, v in c["delta"].items() if v is not None}
        if not self.include_usage:
            body.pop("usage")
        return sse(body)

    def role(self) -> bytes:
        return self._chunk([ChunkChoice(delta=DeltaMessage(role="assistant", content=""))])

    def opening(self) -> list[bytes]:
        return [self.role()]

    def content(self, text: str, logprobs: list[SampledLogprob] | None = None) -> bytes:
        return self._chunk([ChunkChoice(delta=DeltaMessage(content=text), logprobs=choice_logprobs(logprobs))])

    def finish(self, reason: FinishReason) -> bytes:
        return self._chunk([ChunkChoice(delta=DeltaMessage(), finish_reason=reason)])

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> bytes:
        return self._chunk([], usage(prompt_tokens, completion_tokens, cached_tokens))

    error = staticmethod(sse_error)
