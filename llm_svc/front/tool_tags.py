"""tool_choice "auto" with strict function tools: the output constrained to the model's own
tool-call format, as an xgrammar structural tag (``StructuredSpec(kind="structural_tag")``).

The model writes free text (and its reasoning, where the template has it) as it likes; once it
writes the format's call trigger, the call must be one of the request's tools, and a strict
tool's arguments follow its schema. A non-strict tool in the same request may be called too: its
call is held to the format's syntax (well-formed parameters, its own name), its values are not
checked against its schema, as OpenAI leaves a non-strict tool's arguments alone. A name that is
no tool's can not be called at all. ``parallel_tool_calls`` false: at most one call, and the
output ends with it.

xgrammar 0.2.9 has builders for both formats (``get_model_structural_tag("mimo" / "harmony")``),
but their text is not what our templates render and our parsers read, so the tags are built
here from its primitives, with our text:

* "mimo" writes ``<tool_call><function=NAME>...</function></tool_call>`` with no newlines
  (MiMo-V2.6); MiMo-V2-Flash's template (``mmserve/tiny``) renders
  ``<tool_call>\\n<function=NAME>\\n<parameter=K>V</parameter>\\n</function>\\n</tool_call>``,
  so a model trained on it would be forced off its own format. Its reasoning prefix always
  opens ``<think>``; ours depends on ``enable_thinking`` (the prompt opens ``<think>`` for true,
  closes it for false, and the output may open one itself when it is not given).
* "harmony" starts the output at a message header; our gpt-oss template's generation prompt has
  opened a final message already (``<|start|>assistant<|channel|>final<|message|>``), and renders
  a call's header ``<|channel|>commentary to=functions.NAME <|constrain|>json`` with a space that
  xgrammar's first header form lacks.

Parameter values of the MiMo format are xgrammar's ``qwen_xml`` style (strings raw, other values
JSON, whitespace between parameters), which ``llm_svc.parsers.mimo_calls`` reads and coerces by
the schema. A model family with no entry in ``TOOL_FORMATS`` (Gemma 3's pythonic calls) refuses
a strict tool under "auto" with a 400: accepted and then not enforced is what the strict rule
forbids (``shared.schema_keywords``, docs/api.md "Strict schemas").
"""

from __future__ import annotations

import json
from collections.abc import Callable

from shared.registry import Registry
from shared.schemas import StructuredSpec, ToolDef, ToolSpec

from llm_svc.engine.grammar import json_safe_lengths
from llm_svc.parsers import family_of
from llm_svc.parsers.harmony import SPECIALS as HARMONY_SPECIALS
from llm_svc.types.errors import InvalidRequest

# parser family -> builder(tools, parallel, enable_thinking, stop tokens' text) -> the structural tag's "format"
TOOL_FORMATS: Registry[Callable[[list[ToolDef], bool, bool | None, set[str]], dict]] = Registry(
    "structural tool-call format")


def strict_tools(spec: ToolSpec) -> list[int]:
    """Indexes of the tools that ask for ``strict``."""
    return [i for i, t in enumerate(spec.tools) if t.function.strict]


def auto_spec(arch: str, spec: ToolSpec, structured: StructuredSpec | None, enable_thinking: bool | None,
              stops: set[str] = frozenset()) -> StructuredSpec | None:
    """The grammar tool_choice "auto" puts on the output: None without a strict tool (nothing is
    constrained), else the model format's structural tag. Raises ``InvalidRequest`` (400) when
    the request also constrains the output (``structured``) or the model's format has none.
    ``stops``: the text of the model's stop tokens."""
    strict = strict_tools(spec) if spec.choice == "auto" else []
    if not strict:
        return None
    i = strict[0]
    where = f"tools[{i}] (function {spec.tools[i].function.name!r})"
    param = f"tools[{i}].function.strict"
    if structured is not None:
        raise InvalidRequest(
            f"{where} is strict under tool_choice \"auto\": its calls are enforced by a grammar of the model's "
            "tool-call format, which can not be combined with response_format / structured_outputs (text.format "
            "in /v1/responses); drop one of them", param=param)
    family = family_of(arch)
    if family not in TOOL_FORMATS:
        raise InvalidRequest(
            f"{where} is strict, but this model's ({arch}) tool-call format has no grammar here, so a strict "
            "tool can not be enforced under tool_choice \"auto\"; send tool_choice \"required\" (or a named "
            "function), which enforces it, or drop strict", param=param)
    fmt = TOOL_FORMATS.get(family)(spec.tools, spec.parallel, enable_thinking, set(stops))
    return StructuredSpec(kind="structural_tag", spec=json.dumps({"type": "structural_tag", "format": fmt}))


def _schema(tool: ToolDef, style: str) -> dict | bool:
    """The arguments' schema: the tool's own when strict; else any arguments (an object in JSON,
    any parameters in XML). A JSON string bounded in length gets no raw control characters
    (``json_safe_lengths``); a top-level XML string parameter is raw text, kept as sent."""
    f = tool.function
    if not f.strict:
        return True if style == "qwen_xml" else {"type": "object"}
    schema = f.parameters or {"type": "object", "properties": {}}
    if style != "qwen_xml":
        return json_safe_lengths(schema)
    props = schema.get("properties")
    out = json_safe_lengths(schema)
    if isinstance(props, dict):
        out["properties"] = {k: v if isinstance(v, dict) and v.get("type") == "string" else out["properties"][k]
                             for k, v in props.items()}
    return out


def _tag(begin: str, content: dict, end: str | list[str]) -> dict:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _any_text(excludes: list[str] = ()) -> dict:
    return {"type": "any_text", "excludes": list(excludes)}


# --- MiMo (V2-Flash's template; llm_svc.parsers.mimo) ---------------------------------------------

MIMO_CALL_START = "<tool_call>"
# text a raw string value may not hold: the parser would end the value, the function or the call there
# (xgrammar excludes "</parameter>" itself)
_MIMO_VALUE_EXCLUDES = ["<parameter=", "</function>", "</tool_call>"]


@TOOL_FORMATS.register("mimo")
def mimo_format(tools: list[ToolDef], parallel: bool, enable_thinking: bool | None, stops: set[str]) -> dict:
    """Free text with ``<tool_call>`` as the trigger, each tool's call spelled as the template
    renders one; reasoning first as the template's ``enable_thinking`` leaves it."""
    tags = [_tag(f"{MIMO_CALL_START}\n<function={t.function.name}>\n",
                 {"type": "json_schema", "json_schema": _schema(t, "qwen_xml"), "style": "qwen_xml",
                  "excludes": _MIMO_VALUE_EXCLUDES},
                 "</function>\n</tool_call>")
            for t in tools]
    calls = {"type": "triggered_tags", "triggers": [MIMO_CALL_START], "tags": tags,
             "stop_after_first": not parallel}
    if enable_thinking is False:  # the prompt closed the think block: <think> is plain text
        return calls
    think = _tag("" if enable_thinking else "<think>", _any_text(), "</think>")  # true: the prompt opened it
    return {"type": "sequence", "elements": [think if enable_thinking else {"type": "optional", "content": think},
                                             calls]}


_H_NEXT = ("<|start|>", "assistant")  # a further message of the turn
_H_END = "<|end|>"


# --- gpt-oss (our harmony template; llm_svc.parsers.harmony) ---------------------------------------
# The parser reads harmony's markers by token id, so the grammar writes them as their tokens (a
# marker spelled from ordinary tokens would be text to the parser), and free text is any tokens
# but the markers.


def _tok(marker: str) -> dict:
    return {"type": "token", "token": marker}


def _seq(*parts: str | dict) -> dict:
    """Markers as their tokens, other strings as text, formats as they are."""
    elements = [(_tok(p) if p in HARMONY_SPECIALS else _const(p)) if isinstance(p, str) else p for p in parts]
    return {"type": "sequence", "elements": elements}


def _or(*elements: dict) -> dict:
    return {"type": "or", "elements": list(elements)}


@TOOL_FORMATS.register("gpt_oss")
def harmony_format(tools: list[ToolDef], parallel: bool, enable_thinking: bool | None, stops: set[str]) -> dict:
    """The final message the prompt opened, then further messages: analysis, a commentary
    preamble, final, or a call (its body the arguments' JSON, ended by ``<|call|>``). Free text
    holds no marker token, so a header is only ever written where this grammar has one and a call
    can not slip past it. The output ends with the stop token after a final message's text, or
    after a call. A call takes our template's header or one of the forms xgrammar's own harmony
    builder accepts; the parser reads them all. Where ``<|call|>`` is a stop token (gpt-oss's
    generation config) it ends the output: the call is then the last message, and only one."""
    call_stops = "<|call|>" in stops
    text = {"type": "any_tokens", "exclude_tokens": list(HARMONY_SPECIALS)}
    calls = []
    for t in tools:
        # a JSON string holds no marker either: the parser would end the call there
        body = {"type": "json_schema", "json_schema": _schema(t, "json"), "excludes": list(HARMONY_SPECIALS)}
        to = f"to=functions.{t.function.name}"
        headers = [_seq("<|channel|>", f"commentary {to} ", "<|constrain|>", "json", "<|message|>"),
                   _seq("<|channel|>", f"commentary {to}", "<|constrain|>", "json", "<|message|>"),
                   _seq(f" {to}", "<|channel|>", "commentary ", "<|constrain|>", "json", "<|message|>"),
                   _seq(f" {to}", "<|channel|>", "commentary json", "<|message|>")]
        calls.append(_seq(_or(*headers), body, *([] if call_stops else ["<|call|>"])))
    call = _or(*calls)
    message = _or(*(_seq("<|channel|>", ch, "<|message|>", text, _H_END) for ch in ("analysis", "commentary", "final")))
    item = _or(message, call) if parallel and not call_stops else message
    first = _or(_seq(text, _H_END), item)  # the open final message's text, or a header at once
    last = _or(_seq(*_H_NEXT, "<|channel|>", "final", "<|message|>", text), _seq(*_H_NEXT, call))
    turn = _seq(first, {"type": "star", "content": _seq(*_H_NEXT, item)}, {"type": "optional", "content": last})
    return _or(text, turn, call)


def _const(value: str) -> dict:
    return {"type": "const_string", "value": value}
