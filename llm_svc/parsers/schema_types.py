"""String parameter values coerced to the JSON types a tool's schema declares, as vLLM 0.32's
``coerce_to_schema_type`` does for XML-parameter formats (a value stays a string where the
schema says string, or where the parameter is not in the schema)."""

from __future__ import annotations

import json
import math

_ALIASES = {"str": "string", "text": "string", "int": "integer", "float": "number", "double": "number",
            "bool": "boolean", "dict": "object", "list": "array", "arr": "array"}
_ENUM_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
               (dict, "object"))


def tool_properties(tools: list[dict] | None) -> dict[str, dict]:
    """name -> the ``properties`` of its parameters schema, for an OpenAI ``tools`` list."""
    out = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        if isinstance(fn, dict) and fn.get("name"):
            params = fn.get("parameters") or {}
            out[fn["name"]] = params.get("properties") or {} if isinstance(params, dict) else {}
    return out


def schema_types(schema) -> set[str]:
    """The JSON types ``schema`` allows (``type``, ``enum`` values, ``anyOf``/``oneOf``/``allOf``)."""
    if not isinstance(schema, dict):
        return {"string"}
    types: set[str] = set()
    t = schema.get("type")
    for name in [t] if isinstance(t, str) else t if isinstance(t, list) else []:
        if isinstance(name, str):
            types.add(_ALIASES.get(name.strip().lower(), name.strip().lower()))
    for v in schema.get("enum") or [] if isinstance(schema.get("enum"), list) else []:
        types.add("null" if v is None else next((n for k, n in _ENUM_TYPES if isinstance(v, k)), "string"))
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(key) or [] if isinstance(schema.get(key), list) else []:
            types |= schema_types(sub)
    return types or {"string"}


def _finite(v) -> bool:
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, list):
        return all(_finite(x) for x in v)
    if isinstance(v, dict):
        return all(_finite(x) for x in v.values())
    return True


def coerce(value: str, schema) -> object:
    """``value`` as the first of null > integer > number > boolean > object > array > string that
    ``schema`` allows and that parses; a string when none does (or JSON when it parses)."""
    types = schema_types(schema)
    for t in ("null", "integer", "number", "boolean", "object", "array", "string"):
        if t not in types:
            continue
        if t == "null" and value.lower() == "null":
            return None
        if t == "string":
            return value
        if t == "integer":
            try:
                return int(value)
            except ValueError:
                continue
        if t == "number":
            try:
                f = float(value)
            except ValueError:
                continue
            if math.isfinite(f):
                return int(f) if f == int(f) else f
        if t == "boolean" and value.lower().strip() in ("true", "1", "false", "0"):
            return value.lower().strip() in ("true", "1")
        if t in ("object", "array"):
            try:
                parsed = json.loads(value)
            except ValueError:
                continue
            if _finite(parsed):
                return parsed
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    return parsed if _finite(parsed) else value
