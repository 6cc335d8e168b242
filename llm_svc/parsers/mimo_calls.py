"""MiMo's tool call body (between ``<tool_call>`` and ``</tool_call>``) to tool-call deltas, read
as it grows.

The body is ``<function=NAME><parameter=KEY>VALUE</parameter>...</function>``. As in vLLM 0.32's
``_mimo_arg_converter`` a VALUE is taken verbatim (no newline trimming, unlike Qwen3), a
parameter missing its ``</parameter>`` ends where the next ``<parameter=`` starts, and a value
is then coerced to the type the request's tool schema declares (vLLM's ``_fix_arg_types``):
numbers stay strings where the schema says string or names no such parameter.

Streaming: a call's first delta (id, name, ``arguments=""``) goes out once ``<function=NAME>`` is
complete; each parameter goes out once it is complete (its ``</parameter>``, the next
``<parameter=``, ``</function>`` or the body's end), as ``{"k": v`` then ``, "k": v``, and
``}`` (``{}`` without parameters) closes the call: the fragments concatenate to
``json.dumps(args, ensure_ascii=False)``. A repeated key keeps its first value (what was sent
can not be taken back, and the arguments stay an object with unique keys). Several functions in
one body are several calls; a function with an empty name is skipped."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from llm_svc.parsers.base import ToolCallDelta, new_call_id
from llm_svc.parsers.schema_types import coerce

FUNCTION_END = "</function>"
_FUNCTION_OPEN = re.compile(r"<function=([^>]*)>")
# vLLM's one regex, ``<\s*parameter\s*=\s*([^>]*)>(.*?)(?:<\s*/\s*parameter\s*>|(?=<\s*parameter\s*=)|$)``,
# split in two so that a long value is scanned once, not again on every read
_PARAM_OPEN = re.compile(r"<\s*parameter\s*=\s*([^>]*)>")
_PARAM_END = re.compile(r"(<\s*/\s*parameter\s*>)|<\s*parameter\s*=")
_PARAM_END_START = re.compile(r"<\s*(?:/\s*)?" + "".join(f"(?:{c}" for c in "parameter") + r"\s*" + ")?" * 9)


@dataclass
class _Function:
    name: str | None  # None: an empty name, skipped to its </function>
    start: int        # where its body starts in the call body
    index: int = 0
    end_scan: int = 0  # </function> is not before this
    param_pos: int = 0  # where the next parameter is searched
    key: str | None = None  # the open parameter's
    value_start: int = 0
    value_scan: int = 0  # the open parameter's end is not before this
    keys: set[str] = field(default_factory=set)


class CallBodyReader:
    """One ``<tool_call>`` body, given whole so far on each ``read``; calls are numbered from
    ``first_index``."""

    def __init__(self, properties: dict[str, dict], first_index: int):
        self._props = properties
        self._next_index = first_index
        self._pos = 0  # where the next <function= is searched
        self._fn: _Function | None = None
        self.calls = 0  # calls whose name was sent

    def read(self, body: str, closed: bool) -> list[ToolCallDelta]:
        """The deltas that ``body`` (all of it so far) makes certain; ``closed``: the body ended
        at its ``</tool_call>`` (every parameter and function in it is then complete)."""
        out: list[ToolCallDelta] = []
        while True:
            if self._fn is None and not self._open(body, out):
                return out
            fn = self._fn
            end = body.find(FUNCTION_END, fn.end_scan)
            if end < 0 and not closed:
                fn.end_scan = max(fn.start, len(body) - len(FUNCTION_END) + 1)
                if fn.name is not None:
                    self._params(fn, body, len(body), False, out)
                return out
            # without </function> it ends with the body, where ``(.*?)(?:</function>|$)`` ends it
            limit = end if end >= 0 else len(body) - body.endswith("\n")
            if fn.name is not None:
                self._params(fn, body, max(limit, fn.start), True, out)
                out.append(self._close(fn))
            self._fn = None
            self._pos = len(body) if end < 0 else end + len(FUNCTION_END)

    def abandon(self) -> list[ToolCallDelta]:
        """The output ended before ``</tool_call>``: an open call is closed with the parameters
        already complete (an unterminated last one may be cut, so it is dropped)."""
        fn, self._fn = self._fn, None
        return [self._close(fn)] if fn is not None and fn.name is not None else []

    def _open(self, body: str, out: list[ToolCallDelta]) -> bool:
        m = _FUNCTION_OPEN.search(body, self._pos)
        if m is None:
            return False
        name = m.group(1).strip() or None
        self._fn = _Function(name, m.end(), end_scan=m.end(), param_pos=m.end())
        if name is not None:
            self._fn.index, self._next_index = self._next_index, self._next_index + 1
            self.calls += 1
            out.append(ToolCallDelta(self._fn.index, new_call_id(), name, ""))
        return True

    def _params(self, fn: _Function, body: str, limit: int, final: bool, out: list[ToolCallDelta]) -> None:
        """The parameters complete in ``body[:limit]`` (``final``: the function's body ends there)."""
        while True:
            if fn.key is None:
                m = _PARAM_OPEN.search(body, fn.param_pos, limit)
                if m is None:
                    return
                fn.key, fn.value_start = m.group(1), m.end()
                fn.value_scan = fn.param_pos = m.end()
            e = _PARAM_END.search(body, fn.value_scan, limit)
            if e is not None:
                value_end, fn.param_pos = e.start(), e.end() if e.group(1) else e.start()
            elif final:  # ``$``: the end, or just before a final newline
                value_end = limit - (limit > fn.value_start and body[limit - 1] == "\n")
                fn.param_pos = limit
            else:  # the value may still grow; only a "<" at its end may still start its end tag
                lt = body.rfind("<", fn.value_scan, limit)
                fn.value_scan = lt if lt >= 0 and _PARAM_END_START.fullmatch(body, lt, limit) else limit
                return
            self._emit(fn, body[fn.value_start:value_end], out)
            fn.key = None

    def _emit(self, fn: _Function, value: str, out: list[ToolCallDelta]) -> None:
        key, props = fn.key, self._props.get(fn.name, {})
        if key in fn.keys:
            return
        value = coerce(value, props[key]) if isinstance(props.get(key), dict) else value
        lead = ", " if fn.keys else "{"
        fn.keys.add(key)
        out.append(ToolCallDelta(fn.index, arguments=lead + json.dumps(key, ensure_ascii=False) + ": "
                                 + json.dumps(value, ensure_ascii=False)))

    @staticmethod
    def _close(fn: _Function) -> ToolCallDelta:
        return ToolCallDelta(fn.index, arguments="}" if fn.keys else "{}")
