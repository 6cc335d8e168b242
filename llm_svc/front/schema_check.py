"""The LLM service's own check of the schemas it turns into grammars, for callers that reach it
directly (the gateway checks the same first): a JSON Schema keyword the grammar engine would drop
is a 400 ``unsupported_schema_keyword`` (``shared.schema_keywords``)."""

from __future__ import annotations

import json

from shared.schema_keywords import UnsupportedSchemaKeyword, check_schema
from shared.schemas import StructuredSpec, ToolSpec

from llm_svc.types.errors import InvalidRequest


def enforced_tools(spec: ToolSpec) -> list[int]:
    """Indexes of the tools whose parameters are enforced or asked to be: all under "required",
    the named one under a named choice, and every ``strict`` one."""
    named = spec.choice.removeprefix("function:") if spec.choice.startswith("function:") else None
    return [i for i, t in enumerate(spec.tools)
            if t.function.strict or spec.choice == "required" or t.function.name == named]


def check_request_schemas(structured: StructuredSpec | None, tools: ToolSpec | None) -> None:
    """Raise ``InvalidRequest`` (400) naming the first keyword that would not be enforced."""
    try:
        if structured is not None and structured.kind == "json":
            try:
                schema = json.loads(structured.spec)
            except ValueError:
                schema = None  # not JSON: the compiler's error says so
            check_schema(schema, "sampling.structured.spec")
        for i in enforced_tools(tools) if tools is not None else ():
            check_schema(tools.tools[i].function.parameters, f"tools.tools[{i}].function.parameters")
    except UnsupportedSchemaKeyword as e:
        raise InvalidRequest(str(e), param=e.path, code=e.code) from None
