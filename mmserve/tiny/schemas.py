"""A seeded corpus of JSON schemas for structured-output tests and benchmarks: nested objects,
enums, arrays, integers and numbers with bounds, strings with lengths, formats and patterns,
``anyOf``, ``$ref``/``$defs``, optional and required properties.

Every string, array and number here is bounded, so a random-weight model under the schema can
always finish a document within a few hundred tokens (an unbounded string lets it ramble on).
"""

from __future__ import annotations

import random

_PATTERNS = [r"^[a-z]{1,6}$", r"^[A-Z][a-z]{0,4}$", r"^[0-9]{3}-[0-9]{2}$", r"^(yes|no|maybe)$",
             r"^[a-f0-9]{4}$", r"^v[0-9]\.[0-9]$"]
_WORDS = ["red", "green", "blue", "cat", "dog", "fast", "slow", "one", "two", "alpha", "beta", "x y", "é", "a\"b"]


def _leaf(rng: random.Random) -> dict:
    kind = rng.choice(["string", "pattern", "enum", "integer", "number", "boolean", "null", "const", "format"])
    if kind == "string":
        lo = rng.randint(0, 2)
        return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(1, 6)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(_PATTERNS)}
    if kind == "enum":
        return {"enum": rng.sample(_WORDS, rng.randint(1, 4))}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "number":
        lo = rng.randint(-10, 10)
        return {"type": "number", "minimum": lo, "maximum": lo + rng.randint(1, 100)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "null":
        return {"type": "null"}
    if kind == "const":
        return {"const": rng.choice(_WORDS)}
    return {"type": "string", "format": rng.choice(["date", "time", "uuid", "ipv4"])}


def _node(rng: random.Random, depth: int) -> dict:
    if depth <= 0 or rng.random() < 0.35:
        return _leaf(rng)
    shape = rng.choice(["object", "object", "array", "anyOf"])
    if shape == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": _node(rng, depth - 1), "minItems": lo, "maxItems": lo + rng.randint(0, 3)}
    if shape == "anyOf":
        return {"anyOf": [_node(rng, depth - 1) for _ in range(rng.randint(2, 3))]}
    return _object(rng, depth)


def _object(rng: random.Random, depth: int, n_props: int | None = None) -> dict:
    n = rng.randint(1, 5) if n_props is None else n_props
    props = {f"{rng.choice(['id', 'name', 'tag', 'val', 'item', 'note'])}_{i}": _node(rng, depth - 1) for i in range(n)}
    names = list(props)
    required = [p for p in names if rng.random() < 0.7]
    out = {"type": "object", "properties": props, "required": required}
    if rng.random() < 0.8:  # else left out: strict structured output closes the object anyway
        out["additionalProperties"] = False
    return out


def schema_corpus(n: int = 120, seed: int = 0) -> list[dict]:
    """``n`` schemas: a few hand-written shapes first (a ``$ref``, a top-level array, deep
    nesting), then random objects up to depth 4."""
    rng = random.Random(seed)
    fixed = [
        {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                              "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                          "required": ["x", "y"], "additionalProperties": False}},
         "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
         "required": ["a", "b"], "additionalProperties": False},
        {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 4},
        {"type": "object", "properties": {"l1": {"type": "object", "properties": {"l2": {"type": "object", "properties": {
            "l3": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}}, "required": ["l3"],
            "additionalProperties": False}}, "required": ["l2"], "additionalProperties": False}},
         "required": ["l1"], "additionalProperties": False},
        {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                          "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"},
                                                   "maxItems": 3}},
         "required": ["name", "age"], "additionalProperties": False},
    ]
    out = list(fixed)
    while len(out) < n:
        out.append(_object(rng, rng.randint(1, 4)))
    return out[:n]


def wide_schema(n_props: int = 200, seed: int = 1) -> dict:
    """One object with ``n_props`` properties of mixed types (a large grammar to compile)."""
    rng = random.Random(seed)
    props = {f"field_{i}": _node(rng, 2) for i in range(n_props)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
