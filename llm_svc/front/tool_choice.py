"""tool_choice "required" and a named function: the output is constrained to the tools' JSON
(vLLM's schemas) and read straight from it, whatever the model's own tool-call format.

* a named function: the output is that function's arguments object;
* "required": a JSON array of ``{"name": ..., "parameters": {...}}``, one item per call (at most
  one when ``parallel_tool_calls`` is false); a call's name is sent once it is complete, then its
  parameters' JSON text as it arrives.
"""

from __future__ import annotations

import json

from shared.schema_keywords import rebase_refs
from shared.schemas import StructuredSpec, ToolSpec

from llm_svc.parsers.base import ParsedDelta, ToolCallDelta, new_call_id as call_id

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
    items = {"type": "object", "anyOf": [  # each tool's parameters sit at /items/anyOf/i/...: its $refs moved there
        {"properties": {"name": {"type": "string", "enum": [n]},
                        "parameters": rebase_refs(p, f"/items/anyOf/{i}/properties/parameters")},
         "required": ["name", "parameters"]}
        for i, (n, p) in enumerate(params.items())]}
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
    """A JSON array of calls (the grammar of ``forced_spec``), read as it is generated: a call's
    id and name go out once its ``"name"`` string is complete, then its ``"parameters"`` object
    as raw JSON text, piece by piece as it arrives. The arguments are that text as the model
    wrote it (whitespace included where the grammar allowed it), so the streamed pieces and the
    non-streamed arguments are the same string by construction. xgrammar writes the properties
    in the schema's order (name, then parameters); parameters written first would be held back
    until the name is known. A call cut off by ``max_tokens`` keeps what arrived (its arguments
    may be cut JSON, as OpenAI's can be when the finish reason is ``length``)."""

    def __init__(self) -> None:
        self._n = 0              # calls started
        self._depth = 0          # JSON nesting depth: 0 outside the array, 1 in it, 2 in an item
        self._in_str = False
        self._esc = False
        self._tok = ""           # text of the string or key being read at item depth
        self._key: str | None = None   # the item's key whose value comes next
        self._name: str | None = None  # the current item's name, once complete
        self._args: str | None = None  # the current item's parameters text (None: not reached)
        self._args_depth = 0     # depth at which the parameters object opened
        self._held = ""          # parameters text not sent yet (name not known yet)
        self._open = False       # the current item's call was announced

    def feed(self, token_ids: list[int], text: str) -> ParsedDelta:
        out = ParsedDelta()
        for ch in text:
            self._char(ch, out)
        self._flush(out)
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        self._flush(out)
        return out

    @property
    def tool_calls_made(self) -> int:
        return self._n

    def _char(self, ch: str, out: ParsedDelta) -> None:
        if self._args is not None:  # inside the parameters value: every character is arguments
            self._args_char(ch, out)
            return
        if self._in_str:
            if self._string_char(ch):
                self._string_done(out)
            else:
                self._tok += ch
            return
        if ch == '"' and self._depth == 2:
            self._in_str, self._tok = True, ""
        elif ch in "{[":
            self._depth += 1
            if self._depth == 2:
                self._key = self._name = None
                self._open = False
        elif ch in "}]":
            self._depth -= 1
        elif ch == ":" and self._depth == 2 and self._key == "parameters":
            self._args, self._args_depth = "", self._depth

    def _string_char(self, ch: str) -> bool:
        """``ch`` read inside a JSON string: the escape state advanced; True when it closed it."""
        if self._esc:
            self._esc = False
        elif ch == "\\":
            self._esc = True
        elif ch == '"':
            self._in_str = False
            return True
        return False

    def _string_done(self, out: ParsedDelta) -> None:
        try:
            value = json.loads('"' + self._tok + '"')
        except ValueError:
            value = self._tok
        if self._key is None:  # a key
            self._key = value
            return
        if self._key == "name" and self._name is None:
            self._name = value
            self._announce(out)
        self._key = None

    def _args_char(self, ch: str, out: ParsedDelta) -> None:
        if not self._args and ch in " \t\r\n":
            return  # the whitespace before the value belongs to the separator
        self._args += ch
        self._held += ch
        if self._in_str:
            self._string_char(ch)
            return
        if ch == '"':
            self._in_str = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            if self._depth == self._args_depth:  # the parameters object closed
                self._flush(out)
                self._args, self._key = None, None

    def _announce(self, out: ParsedDelta) -> None:
        if not self._open and self._name is not None:
            out.tool_calls.append(ToolCallDelta(index=self._n, id=call_id(), name=self._name))
            self._open = True
            self._n += 1

    def _flush(self, out: ParsedDelta) -> None:
        if self._held and self._open:
            out.tool_calls.append(ToolCallDelta(index=self._n - 1, arguments=self._held))
            self._held = ""
