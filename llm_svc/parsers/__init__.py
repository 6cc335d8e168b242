"""Per-model-family output parsers: a generated output, fed incrementally, split into content,
reasoning and tool calls."""

from __future__ import annotations

from collections.abc import Callable

from llm_svc.parsers.base import OutputParser, ParsedDelta, ToolCallDelta, new_call_id
from llm_svc.parsers.harmony import HarmonyParser
from llm_svc.parsers.mimo import MiMoParser
from llm_svc.parsers.pythonic import PythonicParser
from shared.registry import Registry

__all__ = ["OutputParser", "ParsedDelta", "ToolCallDelta", "new_call_id", "output_parser", "family_of",
           "FAMILIES", "OUTPUT_PARSERS"]

# family -> builder(tokenizer, tools, reasoning, enable_thinking)
OUTPUT_PARSERS: Registry[Callable[..., OutputParser]] = Registry("output parser family")
OUTPUT_PARSERS.add("mimo", lambda tok, tools, reasoning, thinking: MiMoParser(tools, reasoning, thinking))
OUTPUT_PARSERS.add("gemma3", lambda tok, tools, reasoning, thinking: PythonicParser(tools))
OUTPUT_PARSERS.add("gpt_oss", lambda tok, tools, reasoning, thinking: HarmonyParser(tok, tools))
FAMILIES = tuple(OUTPUT_PARSERS)


def output_parser(family: str, tokenizer, *, tools: list[dict] | None, reasoning: bool = True,
                  enable_thinking: bool | None = None) -> OutputParser | None:
    """family: "mimo" | "gemma3" | "gpt_oss" (None returned for an unknown family).
    tools: the request's OpenAI `tools` list (None/[]: tool-call text stays content).
    reasoning: split reasoning out (False: reasoning text stays in content, except harmony,
    whose analysis channel is always reasoning). enable_thinking: the request's
    chat_template_kwargs value (None: the template's default)."""
    if family not in OUTPUT_PARSERS:
        return None
    return OUTPUT_PARSERS.get(family)(tokenizer, tools or None, reasoning, enable_thinking)


def family_of(arch: str) -> str | None:
    """Our loader's arch names (``llm_svc.loading.loader._arch_of``: "mimo", "gemma3", "gpt_oss",
    "other") -> parser family, or None."""
    return arch if arch in OUTPUT_PARSERS else None
