"""Gemma 3: tool calls as a Python list of calls, ``[get_weather(city="Paris"), now()]``, the
whole output starting with ``[`` (vLLM 0.32's ``PythonicToolParser``); no reasoning.

An output that starts with ``[`` is read element by element (brackets counted outside string
literals): each element that is a call with literal keyword arguments is sent whole, id, name
and JSON arguments in one delta, as soon as the ``,`` or ``]`` after it arrives; a call's name
is not sent earlier, because only its arguments show whether the list is calls at all. When the
first element is not such a call (or the output ends first), the whole output is content, as
vLLM's one-shot parse has it. Once a call was sent it stays sent: a later element that is not a
call, or an unfinished one at the end, is content from there on, as is text after the list
(vLLM would make the whole output content).
"""

from __future__ import annotations

import ast
import json

from llm_svc.parsers.base import OutputParser, ParsedDelta, ToolCallDelta, new_call_id


class _NotACall(ValueError):
    pass


def _literal(node: ast.AST):
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _literal(node.operand)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.Dict) and all(k is not None for k in node.keys):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    raise _NotACall(ast.dump(node))


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return _dotted(node.value) + "." + node.attr
    raise _NotACall("call target")


def parse_call(text: str) -> tuple[str, str] | None:
    """``f(a=1)`` -> (name, JSON arguments), or None when ``text`` is not one such call."""
    try:
        call = ast.parse(text.strip(), mode="eval").body
        if not isinstance(call, ast.Call) or call.args or any(k.arg is None for k in call.keywords):
            return None
        args = {k.arg: _literal(k.value) for k in call.keywords}
        return _dotted(call.func), json.dumps(args, ensure_ascii=False)
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return None


class _ListScan:
    """Finds the element separators of a Python list literal that starts a text, fed piecewise."""

    def __init__(self):
        self.pos, self.depth, self.quote, self.escape = 0, 0, "", False

    def next_separator(self, text: str) -> int | None:
        """The index of the next ``,`` between elements or of the closing ``]`` in ``text`` (the
        whole buffer so far), or None until it arrives."""
        while self.pos < len(text):
            c = text[self.pos]
            self.pos += 1
            if self.quote:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == self.quote:
                    self.quote = ""
            elif c in "\"'":
                self.quote = c
            elif c in "([{":
                self.depth += 1
            elif c in ")]}":
                self.depth -= 1
                if self.depth == 0:
                    return self.pos - 1
            elif c == "," and self.depth == 1:
                return self.pos - 1
        return None


class PythonicParser(OutputParser):
    """Content, or a leading pythonic call list when the request has tools."""

    def __init__(self, tools: list[dict] | None):
        self._held = "" if tools else None  # None: streaming content, no call can start any more
        self._scan = _ListScan()
        self._element = 1  # where the element being read starts in _held
        self._calls = 0

    @property
    def tool_calls_made(self) -> int:
        return self._calls

    def feed(self, token_ids: list[int], text: str) -> ParsedDelta:
        if self._held is None:
            return ParsedDelta(content=text)
        self._held += text
        if not self._held:
            return ParsedDelta()
        if not self._held.startswith("["):
            return self._release(0)
        out = ParsedDelta()
        while (sep := self._scan.next_separator(self._held)) is not None:
            element, closes = self._held[self._element:sep], self._scan.depth == 0
            trailing_comma = closes and self._calls and not element.strip() and self._held[sep] == "]"
            call = None if trailing_comma or self._held[sep] not in ",]" else parse_call(element)
            if call is None and not trailing_comma:  # not a call (or a ")" closed the list)
                out.add(self._release(self._element if self._calls else 0))
                return out
            if call is not None:
                out.tool_calls.append(ToolCallDelta(self._calls, new_call_id(), *call))
                self._calls += 1
            self._element = sep + 1
            if closes:
                out.add(self._release(sep + 1))
                return out
        return out

    def finish(self) -> ParsedDelta:
        if not self._held:
            return ParsedDelta()
        return self._release(self._element if self._calls else 0)

    def _release(self, start: int) -> ParsedDelta:
        """``_held`` from ``start`` on is content, and so is everything after it."""
        out, self._held = ParsedDelta(content=self._held[start:]), None
        return out
