"""The schema keyword check: every keyword the grammar engine enforces passes, every one it would
drop is refused naming the keyword and its path, and the tables agree with xgrammar itself (a
string the schema refuses, fed to the compiled grammar)."""

from __future__ import annotations

import json

import pytest

from shared.schema_keywords import ENFORCED, FORMATS, REFUSED, UnsupportedSchemaKeyword, check_schema, rebase_refs

pytestmark = pytest.mark.unit

OBJ = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}

# (schema, a JSON text the schema refuses): the grammar must refuse it too
ENFORCED_CASES = {
    "maxLength": ({"type": "string", "maxLength": 3}, '"abcd"'),
    "minLength": ({"type": "string", "minLength": 3}, '"ab"'),
    "pattern": ({"type": "string", "pattern": "^[a-c]+$"}, '"abd"'),
    "format": ({"type": "string", "format": "date"}, '"x"'),
    "enum": ({"enum": ["a", 1]}, '"b"'),
    "const": ({"const": {"a": 1}}, '{"a":2}'),
    "enum with lengths its values meet": ({"type": "string", "enum": ["ab"], "maxLength": 3}, '"abcd"'),
    "minimum": ({"type": "integer", "minimum": 2}, "1"),
    "maximum": ({"type": "number", "maximum": 5.5}, "6.0"),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 2}, "2"),
    "exclusiveMaximum": ({"type": "number", "exclusiveMaximum": 5.5}, "5.5"),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, "7"),
    "minItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, "[1]"),
    "maxItems": ({"type": "array", "items": {"type": "integer"}, "maxItems": 1}, "[1,2]"),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "string"}], "items": False}, "[1]"),
    "additionalProperties": (OBJ, '{"a":1,"b":2}'),
    "required": (OBJ, "{}"),
    "minProperties": ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2}, '{"a":1}'),
    "maxProperties": ({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1},
                      '{"a":1,"b":2}'),
    "patternProperties": ({"type": "object", "patternProperties": {"^a": {"type": "integer"}},
                           "additionalProperties": False}, '{"b":1}'),
    "propertyNames": ({"type": "object", "additionalProperties": {"type": "integer"},
                       "propertyNames": {"pattern": "^a"}}, '{"b":1}'),
    "$ref/$defs": ({"$defs": {"n": {"type": "object", "properties": {"v": {"type": "integer", "maximum": 3},
                                                                     "k": {"$ref": "#/$defs/m"}},
                                    "required": ["v", "k"], "additionalProperties": False},
                              "m": {"type": "string", "maxLength": 2}}, "$ref": "#/$defs/n"}, '{"v":1,"k":"abc"}'),
    "anyOf": ({"anyOf": [{"type": "integer", "maximum": 3}, {"type": "string", "maxLength": 2}]}, '"abc"'),
    "type list": ({"type": ["string", "null"], "maxLength": 2}, '"abc"'),
}
# (schema, the keyword refused, a JSON text the schema refuses that the grammar accepts)
REFUSED_CASES = {
    "maxLength with pattern": ({"type": "string", "pattern": "^[a-c]+$", "maxLength": 3}, "maxLength", '"abcab"'),
    "minLength with pattern": ({"type": "string", "pattern": "^[a-c]+$", "minLength": 3}, "minLength", '"ab"'),
    "maxLength with format": ({"type": "string", "format": "date", "maxLength": 5}, "maxLength", '"2020-01-01"'),
    "maxLength with enum": ({"type": "string", "enum": ["abcdef", "ab"], "maxLength": 3}, "maxLength", '"abcdef"'),
    "minimum with const": ({"type": "integer", "const": 5, "minimum": 6}, "minimum", "5"),
    "maxLength without type": ({"maxLength": 3}, "maxLength", '"abcd"'),
    "minimum without type": ({"minimum": 3}, "minimum", "1"),
    "multipleOf on a number": ({"type": "number", "multipleOf": 0.5}, "multipleOf", "1.3"),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems", "[1,1]"),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "contains", "[1]"),
    "oneOf": ({"oneOf": [{"type": "integer", "maximum": 3}, {"type": "integer", "minimum": 2}]}, "oneOf", "2"),
    "allOf": ({"allOf": [{"type": "integer", "maximum": 3}, {"type": "integer", "minimum": 2}]}, "allOf", "4"),
    "not": ({"type": "integer", "not": {"const": 3}}, "not", "3"),
    "if": ({"type": "integer", "if": {"minimum": 3}, "then": {"maximum": 5}}, "if", "7"),
    "dependentRequired": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, "dependentRequired", '{"a":1}'),
    "format not spelled out": ({"type": "string", "format": "regex"}, "format", '"("'),
}


def _grammar_accepts(schema: dict, text: str) -> bool:
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    g = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"),
                                     strict_mode=True)
    return _is_grammar_accept_string(g, text)


def _invalid(schema: dict, text: str) -> bool:
    jsonschema = pytest.importorskip("jsonschema")
    try:
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
    except jsonschema.ValidationError:
        return True
    return False


@pytest.mark.parametrize("name", ENFORCED_CASES)
def test_an_enforced_keyword_passes_and_the_grammar_refuses_what_it_forbids(name):
    schema, bad = ENFORCED_CASES[name]
    check_schema(schema, "response_format.json_schema.schema")
    assert _invalid(schema, bad)
    assert not _grammar_accepts(schema, bad), f"xgrammar no longer enforces {name}: move it to REFUSED"


@pytest.mark.parametrize("name", REFUSED_CASES)
def test_a_dropped_keyword_is_refused_naming_it_and_the_grammar_would_drop_it(name):
    schema, keyword, bad = REFUSED_CASES[name]
    with pytest.raises(UnsupportedSchemaKeyword) as e:
        check_schema(schema, "response_format.json_schema.schema")
    assert e.value.keyword == keyword and e.value.code == "unsupported_schema_keyword"
    assert f"'{keyword}'" in str(e.value) and str(e.value).startswith("response_format.json_schema.schema:")
    assert _invalid(schema, bad)
    assert _grammar_accepts(schema, bad), f"xgrammar now enforces {name}: it may move to ENFORCED"


def test_the_path_names_where_the_keyword_sits():
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"anyOf": [
        {"type": "null"}, {"type": "string", "pattern": "^a", "maxLength": 2}]}}, "odd name": {"type": "string"}},
        "$defs": {"x": {"uniqueItems": True}}}
    with pytest.raises(UnsupportedSchemaKeyword) as e:
        check_schema(schema, "tools[1].function.parameters")
    assert e.value.path == "tools[1].function.parameters.properties.items.items.anyOf[1]"
    assert "put the length in the pattern" in str(e.value)
    schema["properties"]["items"]["items"]["anyOf"].pop()
    with pytest.raises(UnsupportedSchemaKeyword) as e:
        check_schema(schema, "p")
    assert (e.value.keyword, e.value.path) == ("uniqueItems", "p.$defs.x")
    schema["properties"]["odd name"]["oneOf"] = []
    with pytest.raises(UnsupportedSchemaKeyword) as e:
        check_schema(schema, "p")
    assert e.value.path == "p.properties['odd name']"


def test_remote_refs_tuple_items_and_deep_nesting_are_refused():
    for schema, kw in (({"$ref": "https://example.com/s.json"}, "$ref"), ({"type": "array", "items": [{}]}, "items")):
        with pytest.raises(UnsupportedSchemaKeyword) as e:
            check_schema(schema, "s")
        assert e.value.keyword == kw
    deep: dict = {"type": "string"}
    for _ in range(200):
        deep = {"type": "array", "items": deep}
    with pytest.raises(UnsupportedSchemaKeyword, match="nested more than"):
        check_schema(deep, "s")


def test_annotations_unknown_keywords_and_booleans_pass():
    check_schema({"type": "object", "title": "T", "description": "d", "default": {}, "examples": [{}],
                  "$schema": "https://json-schema.org/draft/2020-12/schema", "x-order": 1,
                  "properties": {"a": True, "b": {"type": "string", "format": "email", "deprecated": True}}}, "s")
    check_schema(None, "s")


def test_the_tables_do_not_overlap_and_formats_are_spelled_out():
    assert not set(ENFORCED) & set(REFUSED)
    for f in FORMATS:
        check_schema({"type": "string", "format": f}, "s")


def test_rebased_refs_resolve_inside_the_required_tools_grammar():
    """tool_choice "required" nests each tool's parameters at /items/anyOf/i/properties/parameters:
    their #/$defs/... and # references are rewritten to that place, and the grammar enforces them."""
    from llm_svc.engine.grammar import json_safe_lengths
    from llm_svc.front.tool_choice import forced_spec
    from shared.schemas import ToolDef, ToolSpec

    params = {"type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"},
                                               "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
              "required": ["loc", "next"], "additionalProperties": False,
              "$defs": {"Loc": {"type": "string", "maxLength": 3, "enum_like": {"$ref": "#/not/touched"}}}}
    rebased = rebase_refs(params, "/x/0")
    assert rebased["properties"]["loc"]["$ref"] == "#/x/0/$defs/Loc"
    assert rebased["properties"]["next"]["anyOf"][0]["$ref"] == "#/x/0"
    tools = [ToolDef(type="function", function={"name": "g", "parameters": OBJ}),
             ToolDef(type="function", function={"name": "f", "parameters": params, "strict": True})]
    schema = json_safe_lengths(json.loads(forced_spec(ToolSpec(tools=tools, choice="required")).spec))
    ok = '[{"name":"f","parameters":{"loc":"abc","next":{"loc":"a","next":null}}}]'
    assert _grammar_accepts(schema, ok)
    assert not _grammar_accepts(schema, ok.replace('"a"', '"abcd"'))


def test_the_llm_service_refuses_for_direct_callers():
    from llm_svc.front.schema_check import check_request_schemas, enforced_tools
    from llm_svc.types.errors import InvalidRequest
    from shared.schemas import StructuredSpec, ToolDef, ToolSpec

    bad = {"type": "object", "properties": {"s": {"type": "string", "format": "date", "maxLength": 4}}}
    with pytest.raises(InvalidRequest) as e:
        check_request_schemas(StructuredSpec(kind="json", spec=json.dumps(bad)), None)
    assert (e.value.code, e.value.param) == ("unsupported_schema_keyword", "sampling.structured.spec.properties.s")
    tools = [ToolDef(type="function", function={"name": "loose", "parameters": bad}),
             ToolDef(type="function", function={"name": "f", "parameters": bad, "strict": True})]
    assert enforced_tools(ToolSpec(tools=tools, choice="auto")) == [1]
    assert enforced_tools(ToolSpec(tools=tools, choice="function:loose")) == [0, 1]
    assert enforced_tools(ToolSpec(tools=tools[:1], choice="none")) == []
    with pytest.raises(InvalidRequest) as e:
        check_request_schemas(None, ToolSpec(tools=tools, choice="auto"))
    assert e.value.param == "tools.tools[1].function.parameters.properties.s"
    check_request_schemas(None, ToolSpec(tools=tools[:1], choice="auto"))  # a loose tool under auto: not enforced
    check_request_schemas(StructuredSpec(kind="regex", spec="a{2,"), None)  # not a schema: the compiler's to judge


def test_the_gateway_refuses_at_validation_naming_the_field():
    from gateway.errors import APIError
    from gateway.openai_api.requests import ChatCompletionRequest, CompletionRequest
    from gateway.openai_api.responses_api import ResponsesRequest
    from gateway.openai_api.schema_check import check_format_schema, check_tool_schemas
    from gateway.openai_api.responses_format import to_chat

    bad = {"type": "object", "properties": {"n": {"type": "number", "multipleOf": 0.1}}}
    msgs = [{"role": "user", "content": "hi"}]
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": bad}}
    cases = [
        (lambda: check_format_schema(ChatCompletionRequest(model="m", messages=msgs, response_format=rf)),
         "response_format.json_schema.schema.properties.n"),
        (lambda: check_format_schema(CompletionRequest(model="m", prompt="p", structured_outputs={"json": bad})),
         "structured_outputs.json.properties.n"),
        (lambda: check_tool_schemas(ChatCompletionRequest(model="m", messages=msgs, tool_choice="required", tools=[
            {"type": "function", "function": {"name": "f", "parameters": bad}}])),
         "tools[0].function.parameters.properties.n"),
    ]
    # (a strict tool under auto and a text.format together are refused: one request each)
    fmt = ResponsesRequest(model="m", input="hi", text={"format": {"type": "json_schema", "name": "x", "schema": bad}})
    tool = ResponsesRequest(model="m", input="hi", tools=[{"type": "function", "name": "f", "parameters": bad,
                                                           "strict": True}])
    cases += [(lambda: check_format_schema(to_chat(fmt), "text.format"), "text.format.schema.properties.n"),
              (lambda: check_tool_schemas(to_chat(tool), responses=True), "tools[0].parameters.properties.n")]
    for call, path in cases:
        with pytest.raises(APIError) as e:
            call()
        assert (e.value.status, e.value.code, e.value.param) == (400, "unsupported_schema_keyword", path), path
        assert "'multipleOf'" in e.value.message
    # a loose tool under auto is only rendered, never enforced: not checked
    check_tool_schemas(ChatCompletionRequest(model="m", messages=msgs, tools=[
        {"type": "function", "function": {"name": "f", "parameters": bad}}]))
