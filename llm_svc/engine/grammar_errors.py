"""What can go wrong with a structured-output spec, each said in the request's terms."""

from __future__ import annotations

from llm_svc.types.errors import InvalidRequest

# the settings a refusal names (LLMSettings' fields, by their environment names)
MAX_BYTES_SETTING = "MMSERVE_LLM_MAX_GRAMMAR_BYTES"
TIMEOUT_SETTING = "MMSERVE_LLM_GRAMMAR_COMPILE_TIMEOUT_S"

_LABELS = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
           "grammar": "grammar (EBNF)", "structural_tag": "tool-call format (strict tools under tool_choice auto)"}


def spec_label(kind: str) -> str:
    """A spec kind as the request names it (``json`` -> ``json_schema``)."""
    return _LABELS.get(kind, kind)


class GrammarError(ValueError):
    """The spec cannot be compiled: the message names what the engine cannot honour (a 400)."""

    code: str | None = None


class CompileTimeout(GrammarError):
    """The spec took longer to compile than the limit allows (a 400 naming the setting)."""

    code = "grammar_compile_timeout"


class CompilerUnavailable(RuntimeError):
    """The compiler itself failed (its worker could not start, or the engine is shutting down): a 503."""


class GrammarTooLarge(InvalidRequest):
    """The spec is larger than ``max_grammar_bytes``: refused before any compile (a 400)."""


def too_large(kind: str, size: int, limit: int) -> GrammarTooLarge:
    return GrammarTooLarge(
        f"the structured output's {spec_label(kind)} is {size} bytes, more than the {limit} bytes "
        f"{MAX_BYTES_SETTING} allows; send a smaller one (under a forced tool_choice, or with strict tools "
        "under tool_choice auto, it holds every tool's parameters)",
        param="tools" if kind == "structural_tag" else "response_format", code="grammar_too_large")


def timeout_message(kind: str, limit_s: float) -> str:
    return (f"the structured output's {spec_label(kind)} did not compile within {limit_s:g} s of CPU time "
            f"({TIMEOUT_SETTING}); simplify it: fewer or smaller repetition counts (pattern {{n}}, minLength / "
            "maxLength, minItems / maxItems), shallower nesting, shorter enums")
