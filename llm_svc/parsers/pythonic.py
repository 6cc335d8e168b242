"""Gemma 3: tool calls as a Python list of calls, ``[get_weather(city="Paris"), now()]``, the
whole output starting with ``[`` (vLLM 0.32's ``PythonicToolParser``); no reasoning.

An output that starts with ``[`` is held back until its list closes (brackets counted outside
string literals): a list of calls with literal keyword arguments becomes tool calls, anything
else (and an output that ends first) is content after all. Text after the closed list is
content (vLLM would make the whole output content; a call that was already made stays made).
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


def parse_call_list(text: str) -> list[tuple[str, str]] | None:
    """``[f(a=1), g()]`` -> [(name, JSON arguments)], or None when ``text`` is not such a list."""
    try:
        tree = ast.parse(text, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts or not all(isinstance(e, ast.Call) for e in tree.elts):
            return None
        calls = []
        for call in tree.elts:
            if call.args or any(k.arg is None for k in call.keywords):
                return None
            args = {k.arg: _literal(k.value) for k in call.keywords}
            calls.append((_dotted(call.func), json.dumps(args, ensure_ascii=False)))
        return calls
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return None


class _ListEnd:
    """Finds where a Python list literal that starts a text closes, fed piecewise."""

    def __init__(self):
        self.pos, self.depth, self.quote, self.escape = 0, 0, "", False

    def scan(self, text: str) -> int | None:
        """The index just past the closing ``]`` in ``text`` (the whole buffer so far), or None."""
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
                    return self.pos
        return None


class PythonicParser(OutputParser):
    """Content, or a leading pythonic call list when the request has tools."""

    def __init__(self, tools: list[dict] | None):
        self._held = "" if tools else None  # None: streaming content, no call can start any more
        self._end = _ListEnd()
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
            return self._release()
        end = self._end.scan(self._held)
        if end is None:
            return ParsedDelta()
        calls = parse_call_list(self._held[:end])
        if calls is None:
            return self._release()
        out = ParsedDelta(content=self._held[end:])
        for name, args in calls:
            out.tool_calls.append(ToolCallDelta(self._calls, new_call_id(), name, args))
            self._calls += 1
        self._held = None
        return out

    def finish(self) -> ParsedDelta:
        return self._release() if self._held else ParsedDelta()

    def _release(self) -> ParsedDelta:
        out, self._held = ParsedDelta(content=self._held), None
        return out
