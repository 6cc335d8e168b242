"""Named limits on what one request may ask for, checked on the parsed body before any work
is fanned out: prompts x n of a completions batch, tools per request, the size of each schema
that becomes a grammar. Each refusal is a 400 naming the setting that allows more."""

from __future__ import annotations

import json

from gateway.errors import APIError, setting_ref
from gateway.openai_api.requests import ChatCompletionRequest, CompletionRequest, GenerationFields
from gateway.openai_api.schema_check import check_format_schema, check_tool_schemas
from shared.schemas import TokenizeRequest
from shared.settings import GatewaySettings


def _schema_bytes(schema: object) -> int:
    """Size of a schema as the JSON text sent upstream (``json.dumps``, as the grammar spec is)."""
    return len(json.dumps(schema).encode())


def check_completion_prompts(body: CompletionRequest, settings: GatewaySettings) -> None:
    """400 when the batch's prompts x n exceeds ``max_completion_prompts``: each is its own
    generation upstream, all under one admission slot."""
    count = len(body.prompts()) * body.n
    if count > settings.max_completion_prompts:
        raise APIError(
            400, f"prompt: {len(body.prompts())} prompts x n={body.n} = {count} generations exceed the limit of "
            f"{settings.max_completion_prompts} per request (setting {setting_ref('max_completion_prompts')}); "
            "split the batch into smaller requests", param="prompt", code="too_many_prompts",
        )


def check_grammar_size(body: GenerationFields, settings: GatewaySettings,
                       format_param: str = "response_format") -> None:
    """400 when the response_format / structured_outputs grammar spec exceeds ``max_schema_bytes``,
    or holds a schema keyword the grammar would not enforce."""
    spec = body.structured_spec()
    if spec is None or not spec.spec:
        return
    rf = body.response_format
    param = format_param if rf is not None and rf.type != "text" else "structured_outputs"
    size = len(spec.spec.encode())  # the text the grammar compiler gets
    if size > settings.max_schema_bytes:
        raise APIError(
            400, f"{param}: the {spec.kind} spec is {size} bytes, over the limit of {settings.max_schema_bytes} "
            f"(setting {setting_ref('max_schema_bytes')}); send a smaller schema", param=param, code="schema_too_large",
        )
    check_format_schema(body, format_param)


def check_tools(body: ChatCompletionRequest | TokenizeRequest, settings: GatewaySettings, param: str = "tools") -> None:
    """400 past ``max_tools`` tools, or a tool whose parameters schema exceeds ``max_schema_bytes``
    (chat, and /tokenize, whose tools the chat template renders)."""
    tools = body.tools or []
    if len(tools) > settings.max_tools:
        raise APIError(
            400, f"{param}: {len(tools)} tools exceed the limit of {settings.max_tools} per request (setting "
            f"{setting_ref('max_tools')}); send only the tools this turn may call", param=param, code="too_many_tools",
        )
    for i, tool in enumerate(tools):
        if tool.function.parameters is None:
            continue
        size = _schema_bytes(tool.function.parameters)
        if size > settings.max_schema_bytes:
            raise APIError(
                400, f"{param}[{i}]: the parameters schema of {tool.function.name!r} is {size} bytes, over the limit "
                f"of {settings.max_schema_bytes} (setting {setting_ref('max_schema_bytes')}); send a smaller schema",
                param=f"{param}[{i}].function.parameters", code="schema_too_large",
            )


def check_chat_limits(body: ChatCompletionRequest, settings: GatewaySettings, *, tools_param: str = "tools",
                      format_param: str = "response_format") -> None:
    """Every named limit of a chat-shaped request (chat completions, and Responses once turned
    into one: its parameter names differ, hence the params)."""
    check_tools(body, settings, tools_param)
    check_grammar_size(body, settings, format_param)
    check_tool_schemas(body, responses=format_param == "text.format")
