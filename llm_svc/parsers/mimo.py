"""MiMo (V2-Flash, V2.5): reasoning in ``<think>...</think>``, tool calls as
``<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>``.

- ``enable_thinking=True``: the prompt already opened ``<think>``, so the output starts in
  reasoning; ``False``: it starts in content and ``<think>`` is plain text; ``None`` (our
  template's default adds no tag): reasoning only when the output itself opens with ``<think>``.
- A ``<tool_call>`` inside reasoning stays reasoning (it is the model thinking about a call).
- A stray ``</think>`` in content is dropped; whitespace right before ``<tool_call>`` and right
  after ``</tool_call>`` is dropped (the template's separators, not content).
- A call streams (``llm_svc.parsers.mimo_calls``): its name once ``<function=NAME>`` is complete,
  then each parameter once it is complete. A ``<tool_call>`` with no function in it stays
  content (nothing is committed before a ``<function=NAME>``); at ``finish()`` an unterminated
  one whose name was sent stays a call, its arguments closed with the parameters already
  complete (valid JSON), and one with no function yet goes back to content.
- ``reasoning=False``: the think block is kept in content, tags included.
"""

from __future__ import annotations

from llm_svc.parsers.base import OutputParser, ParsedDelta
from llm_svc.parsers.mimo_calls import CallBodyReader
from llm_svc.parsers.scan import find_tag, partial_tail
from llm_svc.parsers.schema_types import tool_properties

THINK_START, THINK_END = "<think>", "</think>"
TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
_START, _REASONING, _CONTENT, _TOOL = "start", "reasoning", "content", "tool"


class MiMoParser(OutputParser):
    """Text-level state machine over MiMo's tags (they are ordinary text in the output)."""

    def __init__(self, tools: list[dict] | None, reasoning: bool = True, enable_thinking: bool | None = None):
        self._tools = bool(tools)
        self._props = tool_properties(tools)
        self._split_reasoning = reasoning
        self._state = {True: _REASONING, False: _CONTENT, None: _START}[enable_thinking]
        self._buf = ""        # text not yet classified
        self._ws = ""         # content whitespace held until we know whether a tool call follows
        self._ws_before_call = ""  # ... and dropped, unless the call turns out not to be one
        self._skip_ws = False  # just after </tool_call>: its trailing whitespace is markup
        self._calls = 0       # calls sent in earlier <tool_call> bodies
        self._body: CallBodyReader | None = None  # the open <tool_call>'s

    @property
    def tool_calls_made(self) -> int:
        return self._calls + (self._body.calls if self._body else 0)

    def feed(self, token_ids: list[int], text: str) -> ParsedDelta:
        self._buf += text
        out = ParsedDelta()
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        while self._step(out, final=True):
            pass
        if self._state == _TOOL and self._body.calls:  # unterminated, but a call was sent
            out.tool_calls.extend(self._body.abandon())
        elif self._state == _TOOL:  # unterminated before any function: back to content, as written
            self._content(out, self._ws_before_call + TOOL_START + self._buf, final=True)
        elif self._state == _REASONING:
            self._reason(out, self._buf)
        else:
            self._content(out, self._buf, final=True)
        self._content(out, "", final=True)
        self._buf = ""
        return out

    # one transition per call; False when the buffer can not advance until more text arrives
    def _step(self, out: ParsedDelta, final: bool) -> bool:
        buf = self._buf
        if self._state == _START:
            if buf.startswith(THINK_START):
                self._buf = buf[len(THINK_START):]
                self._state = _REASONING
                if not self._split_reasoning:
                    out.content += THINK_START
                return True
            if THINK_START.startswith(buf) and not final:
                return False
            self._state = _CONTENT
            return True
        if self._state == _REASONING:
            return self._advance(out, (THINK_END,), self._reason, final)
        if self._state == _CONTENT:
            tags = (TOOL_START, THINK_END) if self._tools else (THINK_END,)
            return self._advance(out, tags, lambda o, t: self._content(o, t, final), final)
        hit = buf.find(TOOL_END)
        if hit < 0:
            out.tool_calls.extend(self._body.read(buf, closed=False))
            return False
        self._buf = buf[hit + len(TOOL_END):]
        self._state = _CONTENT
        out.tool_calls.extend(self._body.read(buf[:hit], closed=True))
        body, self._body = self._body, None
        if not body.calls:  # no function inside: not a call after all
            self._content(out, self._ws_before_call + TOOL_START + buf[:hit + len(TOOL_END)], final)
            return True
        self._calls += body.calls
        self._ws, self._skip_ws = "", True
        return True

    def _advance(self, out: ParsedDelta, tags: tuple[str, ...], emit, final: bool) -> bool:
        hit = find_tag(self._buf, tags)
        if hit is None:
            keep = 0 if final else partial_tail(self._buf, tags)
            emit(out, self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        i, tag = hit
        emit(out, self._buf[:i])
        self._buf = self._buf[i + len(tag):]
        if tag == THINK_END and self._state == _REASONING:
            self._state = _CONTENT
            if not self._split_reasoning:
                out.content += THINK_END
        elif tag == TOOL_START:
            self._ws_before_call, self._ws = self._ws, ""
            self._state = _TOOL
            self._body = CallBodyReader(self._props, self._calls)
        return True

    def _reason(self, out: ParsedDelta, text: str) -> None:
        if self._split_reasoning:
            out.reasoning += text
        else:
            out.content += text

    def _content(self, out: ParsedDelta, text: str, final: bool) -> None:
        if self._skip_ws:
            text = text.lstrip()
            if not text and not final:
                return
            self._skip_ws = False
        text = self._ws + text
        keep = len(text) - len(text.rstrip()) if self._tools and not final else 0
        out.content += text[:len(text) - keep]
        self._ws = text[len(text) - keep:]
