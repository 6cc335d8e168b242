"""MiMo's tool call body (between ``<tool_call>`` and ``</tool_call>``) to (name, JSON arguments).

The body is ``<function=NAME><parameter=KEY>VALUE</parameter>...</function>``. As in vLLM 0.32's
``_mimo_arg_converter`` a VALUE is taken verbatim (no newline trimming, unlike Qwen3), a
parameter missing its ``</parameter>`` ends where the next ``<parameter=`` starts, and a value
is then coerced to the type the request's tool schema declares (vLLM's ``_fix_arg_types``):
numbers stay strings where the schema says string or names no such parameter."""

from __future__ import annotations

import json
import re

from llm_svc.parsers.schema_types import coerce

_FUNCTION = re.compile(r"<function=([^>]*)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAM = re.compile(r"<\s*parameter\s*=\s*([^>]*)>(.*?)(?:<\s*/\s*parameter\s*>|(?=<\s*parameter\s*=)|$)",
                    re.DOTALL)


def parse_calls(body: str, properties: dict[str, dict]) -> list[tuple[str, str]]:
    """The calls in one ``<tool_call>`` body (usually one); [] when it holds no function."""
    calls = []
    for m in _FUNCTION.finditer(body):
        name = m.group(1).strip()
        if not name:
            continue
        props = properties.get(name, {})
        args = {}
        for p in _PARAM.finditer(m.group(2)):
            key, value = p.group(1), p.group(2)
            args[key] = coerce(value, props[key]) if isinstance(props.get(key), dict) else value
        calls.append((name, json.dumps(args, ensure_ascii=False)))
    return calls
