"""tool_choice "required" and a named function: the output is constrained to the tools' JSON
(vLLM's schemas) and read straight from it, whatever the model's own tool-call format.

* a named function: the output is that function's arguments object;
* "required": a JSON array of ``{"name": ..., "parameters": {...}}``, one item per call (at most
  one when ``parallel_tool_calls`` is false); each call is sent once its object is complete.
"""

from __future__ import annotations

import json

from shared.schemas import StructuredSpec, ToolSpec

from .parsers.base import ParsedDelta, ToolCallDelta, new_call_id as call_id

_NO_ARGS = {"type": "object", "properties": {}}


def named_function(spec: ToolSpec) -> str | None:
    return spec.choice.removeprefix("function:") if spec.choice.startswith("function:") else None


def forced_spec(spec: ToolSpec) -> StructuredSpec | None:
    """The grammar a forced tool choice puts on the output (None for "auto" / "none")."""
    params = {t.function.name: t.function.parameters or _NO_ARGS for t in spec.tools}
    name = named_function(spec)
    if name is not None:
        return StructuredSpec(kind="json", spec=json.dumps(params[name]))
    if spec.choice != "required":
        return None
    items = {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": [n]}, "parameters": p}, "required": ["name", "parameters"]}
        for n, p in params.items()]}
    arr: dict = {"type": "array", "minItems": 1, "items": items}
    if not spec.parallel:
        arr["maxItems"] = 1
    return StructuredSpec(kind="json", spec=json.dumps(arr))


class NamedCallParser:
    """The whole output is the arguments of ``name``: every text delta is an arguments piece."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._started = False

    def feed(self, token_ids: list[int], text: str) -> ParsedDelta:
        if not text:
            return ParsedDelta()
        d = ToolCallDelta(index=0, arguments=text)
        if not self._started:
            d.id, d.name, self._started = call_id(), self.name, True
        return ParsedDelta(tool_calls=[d])

    def finish(self) -> ParsedDelta:
        return ParsedDelta()

    @property
    def tool_calls_made(self) -> int:
        return int(self._started)


class RequiredCallsParser:
    """A JSON array of calls, read item by item as each completes."""

    def __init__(self) -> None:
        self._buf = ""
        self._pos = 0
        self._n = 0
        self._dec = json.JSONDecoder()

    def feed(self, token_ids: list[int], text: str) -> ParsedDelta:
        self._buf += text
        out = []
        while True:
            i = self._pos
            while i < len(self._buf) and self._buf[i] in " \t\r\n,[":
                i += 1
            if i >= len(self._buf) or self._buf[i] == "]":
                break
            try:
                obj, end = self._dec.raw_decode(self._buf, i)
            except json.JSONDecodeError:  # the item is not complete yet
                break
            self._pos = end
            if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
                continue  # the grammar rules this out; never a call without a name
            args = json.dumps(obj.get("parameters", {}), ensure_ascii=False)
            out.append(ToolCallDelta(index=self._n, id=call_id(), name=obj["name"], arguments=args))
            self._n += 1
        return ParsedDelta(tool_calls=out)

    def finish(self) -> ParsedDelta:
        return ParsedDelta()

    @property
    def tool_calls_made(self) -> int:
        return self._n
