"""A chat request's generated text as OpenAI answers it: content, reasoning and tool calls.

The model family's parser (``llm_svc.parsers``) splits reasoning and tool-call text out of what
the model writes; a forced tool choice (``llm_svc.front.tool_choice``) reads calls from the JSON its
grammar imposes. ``finish_reason`` becomes ``tool_calls`` as OpenAI's (and vLLM's) does: for
"auto" and "required" when calls were made and the output ended by itself, never for a named
function.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.schemas import GenerateRequest, ToolCallWire

from llm_svc.types.errors import InvalidRequest
from llm_svc.parsers import ToolCallDelta, family_of, output_parser
from .tool_choice import NamedCallParser, RequiredCallsParser, named_function


@dataclass
class Shaped:
    content: str
    reasoning: str | None
    tool_calls: list[ToolCallWire] | None
    finish_reason: str | None


class OutputShaper:
    def __init__(self, parser, mode: str, include_reasoning: bool) -> None:
        self.parser, self.mode, self.include_reasoning = parser, mode, include_reasoning

    def shape(self, token_ids: list[int], text: str, finish_reason: str | None) -> Shaped:
        """One increment of the output (the last one has ``finish_reason``)."""
        d = self.parser.feed(token_ids, text)
        content, reasoning, calls = d.content, d.reasoning, list(d.tool_calls)
        if finish_reason is not None:
            tail = self.parser.finish()
            content, reasoning = content + tail.content, reasoning + tail.reasoning
            calls.extend(tail.tool_calls)
            if finish_reason == "stop" and self.mode in ("auto", "required") and self.parser.tool_calls_made:
                finish_reason = "tool_calls"
        return Shaped(content, reasoning if self.include_reasoning and reasoning else None, _coalesce(calls),
                      finish_reason)


def build_shaper(lm, req: GenerateRequest) -> OutputShaper | None:
    """The shaper of a chat request (None: the text is the content, as it comes)."""
    if not req.messages:
        return None
    spec = req.tools
    mode = "none" if spec is None else spec.choice
    name = named_function(spec) if spec is not None else None
    if name is not None:
        return OutputShaper(NamedCallParser(name), "named", req.include_reasoning)
    if mode == "required":
        return OutputShaper(RequiredCallsParser(), "required", req.include_reasoning)
    family = family_of(lm.arch)
    tools = [t.model_dump(exclude_none=True) for t in spec.tools] if mode == "auto" else None
    parser = output_parser(family, lm.tokenizer, tools=tools, reasoning=True,
                           enable_thinking=req.chat_template_kwargs.get("enable_thinking")) if family else None
    if parser is None:
        if mode == "auto":
            raise InvalidRequest(f"this model ({lm.arch}) has no tool-call parser here; send tool_choice "
                                 '"required" or a named function, or "none"', param="tool_choice")
        return None
    return OutputShaper(parser, mode, req.include_reasoning)


def _coalesce(calls: list[ToolCallDelta]) -> list[ToolCallWire] | None:
    """One increment's pieces, consecutive pieces of one call joined: a stream chunk then holds
    one entry per call, as OpenAI's do, however many tokens the increment had."""
    out: list[ToolCallWire] = []
    for c in calls:
        if out and out[-1].index == c.index and c.id is None:
            out[-1].arguments += c.arguments
        else:
            out.append(ToolCallWire(index=c.index, id=c.id, name=c.name, arguments=c.arguments))
    return out or None


def merge_calls(pieces: list[ToolCallWire]) -> list[ToolCallWire] | None:
    """Stream pieces -> whole calls, one per index (id and name from the first piece)."""
    calls: dict[int, ToolCallWire] = {}
    for p in pieces:
        c = calls.get(p.index)
        if c is None:
            calls[p.index] = p.model_copy()
        else:
            c.arguments += p.arguments
            c.id, c.name = c.id or p.id, c.name or p.name
    return [calls[i] for i in sorted(calls)] or None
