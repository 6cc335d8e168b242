"""The gateway's check of every schema a request turns into a grammar: a JSON Schema keyword the
grammar engine would drop is a 400 ``unsupported_schema_keyword`` naming it and where it sits
(``shared.schema_keywords``), before anything reaches the LLM service."""

from __future__ import annotations

import json

from gateway.errors import APIError
from shared.schema_keywords import UnsupportedSchemaKeyword, check_schema

from .requests import ChatCompletionRequest, GenerationFields, NamedToolChoice


def check_format_schema(body: GenerationFields, format_param: str = "response_format") -> None:
    """``response_format`` (``text.format`` of the Responses API) or ``structured_outputs.json``."""
    rf, so = body.response_format, body.structured_outputs
    try:
        if rf is not None and rf.type == "json_schema":
            where = f"{format_param}.schema" if format_param == "text.format" else f"{format_param}.json_schema.schema"
            check_schema(rf.json_schema.schema_, where)
        elif so is not None and so.json_ is not None:
            try:
                schema = json.loads(so.json_) if isinstance(so.json_, str) else so.json_
            except ValueError:
                schema = None
            check_schema(schema, "structured_outputs.json")
    except UnsupportedSchemaKeyword as e:
        raise _refusal(e) from None


def check_tool_schemas(body: ChatCompletionRequest, responses: bool = False) -> None:
    """Each tool whose parameters become a grammar (tool_choice "required", the named one) or
    that asks for it (``strict``). ``responses``: the Responses API's flat tools name the path."""
    choice = body.tool_choice
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    for i, tool in enumerate(body.tools or ()):
        f = tool.function
        if f.strict or choice == "required" or f.name == named:
            try:
                check_schema(f.parameters, f"tools[{i}].parameters" if responses else f"tools[{i}].function.parameters")
            except UnsupportedSchemaKeyword as e:
                raise _refusal(e) from None


def _refusal(e: UnsupportedSchemaKeyword) -> APIError:
    return APIError(400, str(e), param=e.path, code=e.code)
