"""OpenAI response bodies: ``ChatCompletion`` from a GenerateResponse, and the SSE events of a
stream (role chunk, content deltas, finish chunk, optional usage chunk, ``[DONE]``)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from gateway.openai_api.answers import (
    AssistantMessage,
    ChatCompletion,
    ChatTokenLogprob,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    TopLogprob,
    ChatCompletionChunk,
    Choice,
    ChunkChoice,
    DeltaFunction,
    DeltaMessage,
    DeltaToolCall,
    ToolCallOut,
    PromptLogprobs,
    PromptTokensDetails,
    RankedLogprob,
    Usage,
)
from shared.schemas import (
    SampledLogprob,
    FinishReason,
    FunctionCall,
    ToolCallWire,
    GenerateResponse,
    PromptTokenLogprob,
)

SSE_DONE = b"data: [DONE]\n\n"
_MARK = "\x00"  # a text no id or model name holds in its JSON form ("\u0000", quoted)


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


def prompt_logprobs(entries: list[PromptTokenLogprob] | None, k: int | None) -> PromptLogprobs | None:
    """vLLM's ``prompt_logprobs`` field: per prompt position (None for the first) the prompt token
    and its ``k`` most likely alternatives, by token id (None: not asked)."""
    if entries is None or k is None:
        return None
    out: PromptLogprobs = [None]
    for e in entries[1:]:
        pos = {e.token_id: RankedLogprob(logprob=e.logprob, rank=e.rank, decoded_token=e.token)}
        for rank, a in enumerate(e.top[:k], start=1):
            pos.setdefault(a.token_id, RankedLogprob(logprob=a.logprob, rank=rank, decoded_token=a.token))
        out.append(pos)
    return out


def chat_completion(resps: list[GenerateResponse], model: str, cid: str, created: int,
                    prompt_top: int | None = None) -> ChatCompletion:
    """One choice per response (``n``); usage counts the prompt once (it is computed once);
    ``prompt_top``: the alternatives per position of vLLM's ``prompt_logprobs`` (None: none)."""
    choices = [Choice(index=i, message=assistant_message(r), finish_reason=r.finish_reason,
                      logprobs=choice_logprobs(r.token_logprobs)) for i, r in enumerate(resps)]
    first = resps[0]
    return ChatCompletion(
        id=cid,
        created=created,
        model=model,
        choices=choices,
        usage=usage(first.prompt_tokens, sum(r.completion_tokens for r in resps), first.cached_tokens),
        prompt_logprobs=prompt_logprobs(first.prompt_logprobs, prompt_top),
    )


def sse_error(message: str, type: str = "upstream_error") -> bytes:
    """The ``error`` event of a stream that failed after its headers were sent."""
    return sse({"error": {"message": message, "type": type, "param": None, "code": None}})


def completion_logprobs(entries: list[SampledLogprob] | None, offset: int = 0,
                        prompt: list[PromptTokenLogprob] | None = None, prompt_top: int = 0) -> CompletionLogprobs | None:
    """Our per-token logprobs in the legacy completions form; ``offset``: characters before the
    first token in the choice's text. ``prompt`` (echo): the prompt's tokens lead, with their
    ``prompt_top`` best alternatives (the first token's logprob and alternatives are null)."""
    if entries is None and prompt is None:
        return None
    out = CompletionLogprobs()
    rows = [(e.token, e.logprob, None if e.logprob is None else {a.token: a.logprob for a in e.top[:prompt_top]})
            for e in prompt or ()]
    rows += [(e.token, e.logprob, {a.token: a.logprob for a in e.top}) for e in entries or ()]
    for token, lp, top in rows:
        out.tokens.append(token)
        out.token_logprobs.append(lp)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(token)
    return out


def text_completion(resps: list[GenerateResponse], model: str, cid: str, created: int, logprobs: bool,
                    n: int = 1, echo_top: int | None = None, prompt_top: int | None = None) -> Completion:
    """``n`` choices per prompt of the batch (prompt-major), usage summed over them, each prompt
    counted once. ``echo_top``: echo with logprobs (the prompt's tokens lead the logprobs, with
    this many alternatives); ``prompt_top``: alternatives per position of vLLM's
    ``prompt_logprobs`` field (None: no field)."""
    echoed = echo_top is not None
    choices = [CompletionChoice(index=i, text=r.text, finish_reason=r.finish_reason,
                                logprobs=completion_logprobs(r.token_logprobs, prompt=r.prompt_logprobs if echoed else None,
                                                             prompt_top=echo_top or 0) if logprobs else None,
                                prompt_logprobs=prompt_logprobs(r.prompt_logprobs, prompt_top))
               for i, r in enumerate(resps)]
    u = usage(sum(r.prompt_tokens for r in resps[::n]), sum(r.completion_tokens for r in resps),
              sum(r.cached_tokens for r in resps[::n]))
    return Completion(id=cid, created=created, model=model, choices=choices, usage=u)


class CompletionChunkWriter:
    """The SSE events of one streamed text completion (one prompt)."""

    def __init__(self, cid: str, created: int, model: str, include_usage: bool, logprobs: bool,
                 echo_top: int = 0) -> None:
        self.cid, self.created, self.model = cid, created, model
        self.include_usage, self.logprobs, self.echo_top = include_usage, logprobs, echo_top
        self._offset: dict[int, int] = {}  # per choice: characters of text so far

    def _event(self, choices: list[CompletionChoice], u: Usage | None = None) -> bytes:
        body = Completion(id=self.cid, created=self.created, model=self.model, choices=choices, usage=u).model_dump()
        if not self.include_usage:
            body.pop("usage")
        return sse(body)

    def opening(self, index: int = 0) -> list[bytes]:
        return []

    def content(self, text: str, entries: list[SampledLogprob] | None = None, reasoning: str | None = None,
                tool_calls: list[ToolCallWire] | None = None, index: int = 0,
                prompt_logprobs: list[PromptTokenLogprob] | None = None) -> bytes:
        """``prompt_logprobs`` (echo with logprobs: on the first content) lead the logprobs."""
        lp = None
        if self.logprobs and (entries is not None or prompt_logprobs is not None):
            lp = completion_logprobs(entries, self._offset.get(index, 0), prompt_logprobs, self.echo_top)
            self._offset[index] = lp.text_offset[-1] + len(lp.tokens[-1]) if lp.tokens else self._offset.get(index, 0)
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
        self._text_frames: dict[int, tuple[bytes, bytes]] = {}  # choice index -> the bytes around a text delta

    def _text_frame(self, index: int) -> tuple[bytes, bytes] | None:
        """The event of a text-only delta of choice ``index`` as the bytes before and after the
        text's JSON string, cut from the full path's own output (so the two cannot differ)."""
        frame = self._text_frames.get(index)
        if frame is None:
            mark = json.dumps(_MARK).encode()
            event = self._chunk([ChunkChoice(index=index, delta=DeltaMessage(content=_MARK))])
            if event.count(mark) != 1:
                return None
            frame = self._text_frames[index] = tuple(event.split(mark))
        return frame

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
                tool_calls: list[ToolCallWire] | None = None, index: int = 0,
                prompt_logprobs: list[PromptTokenLogprob] | None = None) -> bytes:
        """``prompt_logprobs``: never in a chat stream (refused with stream=true)."""
        if logprobs is None and not reasoning and not tool_calls:
            frame = self._text_frame(index)
            if frame is not None:  # one event per token: no models built, only the text encoded
                return frame[0] + json.dumps(text).encode() + frame[1]
        delta = DeltaMessage(content=text or None if (reasoning or tool_calls) else text,
                             reasoning=reasoning or None, reasoning_content=reasoning or None,
                             tool_calls=delta_tool_calls(tool_calls))
        return self._chunk([ChunkChoice(index=index, delta=delta, logprobs=choice_logprobs(logprobs))])

    def finish(self, reason: FinishReason, index: int = 0) -> bytes:
        return self._chunk([ChunkChoice(index=index, delta=DeltaMessage(), finish_reason=reason)])

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> bytes:
        return self._chunk([], usage(prompt_tokens, completion_tokens, cached_tokens))

    error = staticmethod(sse_error)
