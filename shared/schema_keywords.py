"""Which JSON Schema keywords the grammar engine enforces, and the check that refuses the others.

xgrammar 0.2.8-0.2.9 compiles a schema it cannot fully enforce without an error: it logs a
warning and drops the keyword (``pattern combined with minLength/maxLength is not supported;
ignoring minLength/maxLength``), so an output can break the schema the client sent. Every schema
that becomes a grammar (``response_format``, ``structured_outputs.json``, ``text.format``, strict
or forced tools) is walked here first; a keyword it would drop is a 400 naming the keyword, where
it sits, and what to send instead. The tables were measured against xgrammar directly (a string
the schema refuses, fed to the compiled grammar: accepted means dropped).
"""

from __future__ import annotations

import re
from typing import Any

# keyword -> what it constrains (all enforced by the grammar)
ENFORCED: dict[str, str] = {
    "type": "the JSON type (one, or a list)",
    "enum": "one of the listed values", "const": "exactly this value",
    "properties": "each named property's schema", "required": "the properties that must appear",
    "additionalProperties": "false, or a schema for the other properties (strict: false when absent)",
    "patternProperties": "schemas of properties whose names match", "propertyNames": "the names' schema",
    "minProperties": "at least this many properties", "maxProperties": "at most this many properties",
    "items": "every item's schema (an object, or false)", "prefixItems": "the leading items' schemas",
    "minItems": "at least this many items", "maxItems": "at most this many items",
    "minLength": "at least this many characters", "maxLength": "at most this many characters",
    "pattern": "a regular expression the whole string matches", "format": "one of FORMATS",
    "minimum": "a lower bound", "maximum": "an upper bound",
    "exclusiveMinimum": "a strict lower bound (a number)", "exclusiveMaximum": "a strict upper bound (a number)",
    "multipleOf": "integers only", "anyOf": "at least one of the schemas",
    "$ref": "a local reference (#/$defs/..., #/definitions/..., #)", "$defs": "reusable schemas",
    "definitions": "reusable schemas (older drafts)",
}
# string formats the grammar spells out (others would be any string)
FORMATS = ("date", "date-time", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri",
           "uri-reference", "json-pointer")
# keyword -> what to send instead (never enforced)
REFUSED: dict[str, str] = {
    "oneOf": "use anyOf (the grammar cannot exclude an output that matches several branches)",
    "allOf": "merge the schemas into one",
    "not": "remove it; list the allowed values or shapes instead",
    "if": "remove if/then/else; use anyOf of the allowed shapes",
    "then": "remove if/then/else; use anyOf of the allowed shapes",
    "else": "remove if/then/else; use anyOf of the allowed shapes",
    "dependentRequired": "list the properties in required, or use anyOf of the allowed shapes",
    "dependentSchemas": "use anyOf of the allowed shapes",
    "dependencies": "list the properties in required, or use anyOf of the allowed shapes",
    "uniqueItems": "remove it (repeated items cannot be excluded); check uniqueness after parsing",
    "contains": "remove it, or use prefixItems for the item that must be there",
    "minContains": "remove it", "maxContains": "remove it",
    "unevaluatedProperties": 'use "additionalProperties": false',
    "unevaluatedItems": "use prefixItems and items: false",
    "additionalItems": "use prefixItems and items",
    "$dynamicRef": "use a local $ref", "$recursiveRef": "use a local $ref",
}
_LENGTHS = ("minLength", "maxLength")
_STRING_ONLY = ("minLength", "maxLength", "pattern", "format")
_NUMBER_ONLY = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_VALUE_BOUNDS = _STRING_ONLY + _NUMBER_ONLY + ("minItems", "maxItems", "minProperties", "maxProperties")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMAS = ("items", "additionalProperties", "propertyNames", "not", "if", "then", "else", "contains",
            "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_NAME = re.compile(r"^[A-Za-z_$][A-Za-z0-9_$]*$")
MAX_DEPTH = 128  # schema nesting walked; deeper is refused (the walk recurses)


class UnsupportedSchemaKeyword(ValueError):
    """A keyword the grammar would drop: ``keyword``, ``path`` (where it sits, from the request's
    field), and a message that says what to change. HTTP 400, code ``unsupported_schema_keyword``."""

    code = "unsupported_schema_keyword"

    def __init__(self, keyword: str, path: str, why: str) -> None:
        super().__init__(f"{path}: the JSON Schema keyword {keyword!r} cannot be enforced by this server's "
                         f"grammar engine ({why}); change the schema, or see docs/api.md#structured-outputs for "
                         "the keywords that are enforced")
        self.keyword, self.path = keyword, path


def check_schema(schema: Any, path: str) -> None:
    """Raise ``UnsupportedSchemaKeyword`` for the first keyword of ``schema`` (at ``path``, e.g.
    ``response_format.json_schema.schema``) that the grammar would not enforce."""
    _walk(schema, path, 0)


def _child(path: str, key: str) -> str:
    return f"{path}.{key}" if _NAME.match(key) else f"{path}[{key!r}]"


def _walk(node: Any, path: str, depth: int) -> None:
    if not isinstance(node, dict):
        return  # true / false / a malformed node: the compiler's own error names it
    if depth > MAX_DEPTH:
        raise UnsupportedSchemaKeyword(next(iter(node), "{}"), path, f"schemas nested more than {MAX_DEPTH} levels "
                                       "deep are not served; flatten the schema")
    for kw in node:
        if kw in REFUSED:
            raise UnsupportedSchemaKeyword(kw, path, REFUSED[kw])
    ref = node.get("$ref")
    if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
        raise UnsupportedSchemaKeyword("$ref", path, "only local references (#/$defs/...) are resolved; put the "
                                       "referenced schema in $defs")
    if isinstance(node.get("items"), list):
        raise UnsupportedSchemaKeyword("items", path, "a list of item schemas is the old tuple form; use prefixItems")
    _check_combinations(node, path)
    for k in _SCHEMAS:
        if k in node:
            sub = node[k]
            if k == "propertyNames" and isinstance(sub, dict):
                sub = {"type": "string", **sub}  # names are strings: a pattern here needs no type
            _walk(sub, _child(path, k), depth + 1)
    for k in _SCHEMA_LISTS:
        if isinstance(node.get(k), list):
            for i, sub in enumerate(node[k]):
                _walk(sub, f"{_child(path, k)}[{i}]", depth + 1)
    for k in _SCHEMA_MAPS:
        if isinstance(node.get(k), dict):
            for name, sub in node[k].items():
                _walk(sub, _child(_child(path, k), str(name)), depth + 1)


def _types(node: dict) -> set[str]:
    t = node.get("type")
    return {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()


def _check_combinations(node: dict, path: str) -> None:
    """Keywords the grammar enforces alone but drops in company."""
    types = _types(node)
    fmt = node.get("format")
    if fmt is not None and fmt not in FORMATS:
        raise UnsupportedSchemaKeyword("format", path, f"format {fmt!r} is not spelled out by the grammar (these are: "
                                       f"{', '.join(FORMATS)}); use a pattern instead")
    if "multipleOf" in node and types != {"integer"}:
        raise UnsupportedSchemaKeyword("multipleOf", path, 'it is enforced for "type": "integer" only; drop it or '
                                       "make the value an integer count of the unit")
    if "enum" in node or "const" in node:
        values = node["enum"] if isinstance(node.get("enum"), list) else [node.get("const")]
        for kw in _VALUE_BOUNDS:
            if kw in node and not all(_meets(v, kw, node[kw]) for v in values):
                raise UnsupportedSchemaKeyword(kw, path, "with enum / const the output is one of the listed values "
                                               f"and {kw} is not applied to them; list only values that meet it")
        return
    lengths = [k for k in _LENGTHS if k in node]
    for other in ("pattern", "format"):
        if lengths and other in node:
            raise UnsupportedSchemaKeyword(lengths[0], path, f"{lengths[0]} together with {other} is dropped; put the "
                                           "length in the pattern (e.g. ^[a-z]{1,8}$) and remove "
                                           f"{' and '.join(lengths)}")
    if "pattern" in node and "format" in node:
        raise UnsupportedSchemaKeyword("pattern", path, "pattern together with format: only one is applied; keep one")
    if not types and "$ref" not in node and "anyOf" not in node:
        for kw in _STRING_ONLY + _NUMBER_ONLY:
            if kw in node:
                raise UnsupportedSchemaKeyword(kw, path, f'{kw} without "type" is not applied; add "type" (e.g. '
                                               f'"{"string" if kw in _STRING_ONLY else "number"}")')


def _meets(value: Any, kw: str, bound: Any) -> bool:
    """Whether a listed enum / const value meets ``kw`` (JSON Schema: a bound of another type's
    keyword does not apply). A keyword this cannot evaluate counts as not met."""
    is_num = isinstance(value, (int, float)) and not isinstance(value, bool)
    try:
        if kw in _STRING_ONLY and not isinstance(value, str) or kw in _NUMBER_ONLY and not is_num:
            return True
        if kw in ("minItems", "maxItems") and not isinstance(value, list) or \
                kw in ("minProperties", "maxProperties") and not isinstance(value, dict):
            return True
        if kw in ("minLength", "minItems", "minProperties"):
            return len(value) >= bound
        if kw in ("maxLength", "maxItems", "maxProperties"):
            return len(value) <= bound
        if kw == "pattern":
            return re.search(bound, value) is not None
        if kw == "minimum":
            return value >= bound
        if kw == "maximum":
            return value <= bound
        if kw == "exclusiveMinimum":
            return value > bound
        if kw == "exclusiveMaximum":
            return value < bound
        if kw == "multipleOf":
            return (value / bound) == int(value / bound)
    except (TypeError, re.error, ZeroDivisionError, OverflowError):
        return False
    return False  # format: not evaluated here


def rebase_refs(schema: Any, base: str) -> Any:
    """``schema`` with every local ``$ref`` rewritten for its new place at JSON pointer ``base``
    (e.g. ``/items/anyOf/0/properties/parameters``) inside a larger schema: ``#/$defs/X`` becomes
    ``#<base>/$defs/X`` and ``#`` becomes ``#<base>``, so the references still resolve."""
    if isinstance(schema, list):
        return [rebase_refs(x, base) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: rebase_refs(v, base) if k not in ("enum", "const", "default", "examples") else v
           for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = "#" + base + ref[1:]
    return out
