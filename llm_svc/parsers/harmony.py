"""gpt-oss: the harmony format, parsed over its special-token ids.

An assistant turn is messages ``<|start|>assistant<|channel|>CHANNEL[ to=RECIPIENT][<|constrain|>json]
<|message|>BODY<|end|>`` (a tool call ends in ``<|call|>``, the last message in ``<|return|>``).
Channel ``analysis`` is reasoning (always, whatever ``reasoning`` says), ``final`` is content,
``commentary`` to ``functions.NAME`` is a call of NAME with BODY as its JSON arguments,
``commentary`` without a recipient is content (a preamble).
The output starts inside a message of channel ``final``: our template's generation prompt opens
it (``<|start|>assistant<|channel|>final<|message|>``); a header the model writes itself
(``<|channel|>...`` first) is parsed as one.

Why not ``openai-harmony``: its ``StreamableParser`` consumes o200k-harmony token ids and decodes
them with that vocabulary. It loads offline here, but the ids our checkpoints emit are their own
tokenizer's (the tiny test tokenizer is a 640-entry BPE with harmony's special tokens), so it
can not read them; only the few special-token ids matter to the structure, and the text between
them is decoded with the checkpoint's own tokenizer. The ``text`` argument of ``feed`` is not
used: special tokens are skipped in it, and they are what delimits the messages.

A call streams as vLLM's harmony path does: id and name when its header's ``<|message|>``
arrives, then BODY's text as it decodes (leading whitespace dropped), so the arguments are the
model's JSON text as written, not re-serialised. A body that does not start with ``{`` can not
be an object: it is held to the message's end and sent whole, ``{"value": ...}`` around valid
JSON, as written otherwise; an empty body is ``{}``. An unterminated call (the output ended in
its body) stays a call with the text that arrived, which may be cut JSON, as OpenAI's may be when
``finish_reason`` is ``length``.
"""

from __future__ import annotations

import json
import re

from llm_svc.parsers.base import OutputParser, ParsedDelta, ToolCallDelta, new_call_id

SPECIALS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>")
_RECIPIENT = re.compile(r"to=([^\s<]+)")


class HarmonyParser(OutputParser):
    """Token-level state machine: header (``<|start|>``/``<|channel|>`` .. ``<|message|>``), body."""

    def __init__(self, tokenizer, tools: list[dict] | None):
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIALS}
        self._special = {i: t for t, i in ids.items() if isinstance(i, int) and i != tokenizer.unk_token_id}
        self._tok = tokenizer
        self._tools = bool(tools)
        self._in_header = False
        self._header = ""
        self._channel, self._recipient = "final", None
        self._body = ""          # a call's body text held back (before its first "{", or all of it)
        self._mode = ""          # the open call's body: "" not known yet, "stream" (it starts with "{"), "hold"
        self._run: list[int] = []  # ordinary ids not yet decoded (an unfinished UTF-8 sequence)
        self._calls = 0

    @property
    def tool_calls_made(self) -> int:
        return self._calls

    def feed(self, token_ids: list[int], text: str) -> ParsedDelta:
        out = ParsedDelta()
        for t in token_ids:
            tag = self._special.get(t)
            if tag is None:
                self._run.append(t)
                continue
            self._flush(out, final=True)
            self._on_special(out, tag)
        self._flush(out, final=False)
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        self._flush(out, final=True)
        if self._is_call() and not self._in_header:  # unterminated: the call stays, as far as it got
            self._close_call(out)
        return out

    def _flush(self, out: ParsedDelta, final: bool) -> None:
        if not self._run:
            return
        text = self._tok.decode(self._run, skip_special_tokens=False)
        if text.endswith("\ufffd") and not final:
            return  # byte-level tokens of one character still arriving
        self._run = []
        if self._in_header:
            self._header += text
        elif self._is_call():
            self._call_text(out, text)
        elif self._channel == "analysis":
            out.reasoning += text
        else:
            out.content += text

    def _on_special(self, out: ParsedDelta, tag: str) -> None:
        """One special token: a header opens or grows, a message opens or ends."""
        if tag in ("<|start|>", "<|channel|>"):
            if not self._in_header:
                if self._is_call():  # a new message, the call's own end tag missing
                    self._close_call(out)
                self._in_header, self._header = True, ""
            self._header += " " + tag + " "
        elif tag == "<|constrain|>":
            self._header += " " + tag + " "
        elif tag == "<|message|>" and self._in_header:
            self._open(out, self._header)
        elif tag in ("<|end|>", "<|call|>", "<|return|>") and not self._in_header:
            if self._is_call():
                self._close_call(out)
            self._channel, self._recipient = "final", None

    def _open(self, out: ParsedDelta, header: str) -> None:
        self._in_header = False
        after = header.rsplit("<|channel|>", 1)[1] if "<|channel|>" in header else ""
        words = after.replace("<|constrain|>", " ").split()
        self._channel = words[0] if words else "final"
        m = _RECIPIENT.search(header)
        self._recipient = m.group(1) if m else None
        self._body, self._mode = "", ""
        if self._is_call():
            out.tool_calls.append(ToolCallDelta(self._calls, new_call_id(), self._recipient[len("functions."):], ""))
            self._calls += 1

    def _is_call(self) -> bool:
        return self._tools and bool(self._recipient) and self._recipient.startswith("functions.")

    def _call_text(self, out: ParsedDelta, text: str) -> None:
        if self._mode == "stream":
            out.tool_calls.append(ToolCallDelta(self._calls - 1, arguments=text))
            return
        self._body += text
        if not self._mode and self._body.strip():
            self._mode = "stream" if self._body.lstrip().startswith("{") else "hold"
            if self._mode == "stream":
                out.tool_calls.append(ToolCallDelta(self._calls - 1, arguments=self._body.lstrip()))
                self._body = ""

    def _close_call(self, out: ParsedDelta) -> None:
        """The open call's message ended: a body held back is sent whole (see the module doc)."""
        if self._mode != "stream":
            body = self._body.strip()
            try:
                args = json.dumps({"value": json.loads(body)})
            except ValueError:
                args = body or "{}"
            out.tool_calls.append(ToolCallDelta(self._calls - 1, arguments=args))
        self._body, self._mode = "", ""
