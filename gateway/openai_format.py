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
    DeltaFunction,
    DeltaMessage,
    DeltaToolCall,
    FinishReason,
    FunctionCall,
    ToolCallOut,
    ToolCallWire,
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


def assistant_message(resp: GenerateResponse) -> AssistantMessage:
    """content (None when the answer is tool calls alone, as OpenAI), tool_calls, reasoning."""
    calls = [ToolCallOut(id=c.id or "", function=FunctionCall(name=c.name or "", arguments=c.arguments or "{}"))
             for c in resp.tool_calls or ()]
    content = resp.text if resp.text or not calls else None
    return AssistantMessage(content=content, tool_calls=calls or None, reasoning=resp.reasoning,
                            reasoning_content=resp.reasoning)


def delta_tool_calls(pieces: list[ToolCallWire] | None) -> list[DeltaToolCall] | None:
    if not pieces:
        return None
    return [DeltaToolCall(index=p.index, id=p.id, type="function" if p.id else None,
                          function=DeltaFunction(name=p.name, arguments=p.arguments))
            for p in pieces]


def chat_completion(resps: list[GenerateResponse], model: str, cid: str, created: int) -> ChatCompletion:
    """One choice per response (``n``); usage counts the prompt once (it is computed once)."""
    choices = [Choice(index=i, message=assistant_message(r), finish_reason=r.finish_reason,
                      logprobs=choice_logprobs(r.token_logprobs)) for i, r in enumerate(resps)]
    first = resps[0]
    return ChatCompletion(
        id=cid,
        created=created,
        model=model,
        choices=choices,
        usage=usage(first.prompt_tokens, sum(r.completion_tokens for r in resps), first.cached_tokens),
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


def text_completion(resps: list[GenerateResponse], model: str, cid: str, created: int, logprobs: bool,
                    n: int = 1) -> Completion:
    """``n`` choices per prompt of the batch (prompt-major), usage summed over them, each prompt
    counted once."""
    choices = [CompletionChoice(index=i, text=r.text, finish_reason=r.finish_reason,
                                logprobs=completion_logprobs(r.token_logprobs if logprobs else None))
               for i, r in enumerate(resps)]
    u = usage(sum(r.prompt_tokens for r in resps[::n]), sum(r.completion_tokens for r in resps),
              sum(r.cached_tokens for r in resps[::n]))
    return Completion(id=cid, created=created, model=model, choices=choices, usage=u)


class CompletionChunkWriter:
    """The SSE events of one streamed text completion (one prompt)."""

    def __init__(self, cid: str, created: int, model: str, include_usage: bool, logprobs: bool) -> None:
        self.cid, self.created, self.model = cid, created, model
        self.include_usage, self.logprobs = include_usage, logprobs
        self._offset: dict[int, int] = {}  # per choice: characters of text so far

    def _event(self, choices: list[CompletionChoice], u: Usage | None = None) -> bytes:
        body = Completion(id=self.cid, created=self.created, model=self.model, choices=choices, usage=u).model_dump()
        if not self.include_usage:
            body.pop("usage")
        return sse(body)

    def opening(self, index: int = 0) -> list[bytes]:
        return []

    def content(self, text: str, entries: list[SampledLogprob] | None = None, reasoning: str | None = None,
                tool_calls: list[ToolCallWire] | None = None, index: int = 0) -> bytes:
        lp = completion_logprobs(entries, self._offset.get(index, 0)) if self.logprobs and entries is not None else None
        self._offset[index] = self._offset.get(index, 0) + sum(len(e.token) for e in entries or ())
        return self._event([CompletionChoice(index=index, text=text, logprobs=lp)])

    def finish(self, reason: FinishReason, index: int = 0) -> bytes:
        return self._event([CompletionChoice(index=index, text="", finish_reason=reason)])

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
            for t in c["delta"].get("tool_calls", ()):
                for k in [k for k, v in t.items() if v is None]:
                    del t[k]
                t["function"] = {k: v for k, v in t["function"].items() if v is not None}
        if not self.include_usage:
            body.pop("usage")
        return sse(body)

    def role(self, index: int = 0) -> bytes:
        return self._chunk([ChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])

    def opening(self, index: int = 0) -> list[bytes]:
        return [self.role(index)]

    def content(self, text: str, logprobs: list[SampledLogprob] | None = None, reasoning: str | None = None,
                tool_calls: list[ToolCallWire] | None = None, index: int = 0) -> bytes:
        delta = DeltaMessage(content=text or None if (reasoning or tool_calls) else text,
                             reasoning=reasoning or None, reasoning_content=reasoning or None,
                             tool_calls=delta_tool_calls(tool_calls))
        return self._chunk([ChunkChoice(index=index, delta=delta, logprobs=choice_logprobs(logprobs))])

    def finish(self, reason: FinishReason, index: int = 0) -> bytes:
        return self._chunk([ChunkChoice(index=index, delta=DeltaMessage(), finish_reason=reason)])

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> bytes:
        return self._chunk([], usage(prompt_tokens, completion_tokens, cached_tokens))

    error = staticmethod(sse_error)
