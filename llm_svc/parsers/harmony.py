"""gpt-oss: the harmony format, parsed over its special-token ids.

An assistant turn is messages ``<|start|>assistant<|channel|>CHANNEL[ to=RECIPIENT][<|constrain|>json]
<|message|>BODY<|end|>`` (a tool call ends in ``<|call|>``, the last message in ``<|return|>``).
Channel ``analysis`` is reasoning (always, whatever ``reasoning`` says), ``final`` is content,
``commentary`` to ``functions.NAME`` is a call of NAME with BODY as its JSON arguments (emitted
whole at ``<|call|>``/``<|end|>``), ``commentary`` without a recipient is content (a preamble).
The output starts inside a message of channel ``final``: our template's generation prompt opens
it (``<|start|>assistant<|channel|>final<|message|>``); a header the model writes itself
(``<|channel|>...`` first) is parsed as one.

Why not ``openai-harmony``: its ``StreamableParser`` consumes o200k-harmony token ids and decodes
them with that vocabulary. It loads offline here, but the ids our checkpoints emit are their own
tokenizer's (the tiny test tokenizer is a 640-entry BPE with harmony's special tokens), so it
can not read them; only the few special-token ids matter to the structure, and the text between
them is decoded with the checkpoint's own tokenizer. The ``text`` argument of ``feed`` is not
used: special tokens are skipped in it, and they are what delimits the messages.
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
        self._body = ""          # a tool call's arguments so far
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
        if self._is_call() and not self._in_header:  # unterminated call: its text is content
            out.content += self._body
            self._body = ""
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
            self._body += text
        elif self._channel == "analysis":
            out.reasoning += text
        else:
            out.content += text

    def _on_special(self, out: ParsedDelta, tag: str) -> None:
        if tag in ("<|start|>", "<|channel|>"):
            if not self._in_header:
                self._in_header, self._header = True, ""
            self._header += " " + tag + " "
        elif tag == "<|constrain|>":
            self._header += " " + tag + " "
        elif tag == "<|message|>" and self._in_header:
            self._open(self._header)
        elif tag in ("<|end|>", "<|call|>", "<|return|>") and not self._in_header:
            if self._is_call():
                self._emit_call(out)
            self._channel, self._recipient = "final", None

    def _open(self, header: str) -> None:
        self._in_header = False
        after = header.rsplit("<|channel|>", 1)[1] if "<|channel|>" in header else ""
        words = after.replace("<|constrain|>", " ").split()
        self._channel = words[0] if words else "final"
        m = _RECIPIENT.search(header)
        self._recipient = m.group(1) if m else None
        self._body = ""

    def _is_call(self) -> bool:
        return self._tools and bool(self._recipient) and self._recipient.startswith("functions.")

    def _emit_call(self, out: ParsedDelta) -> None:
        body = self._body.strip()
        try:
            args = body if isinstance(json.loads(body), dict) else json.dumps({"value": json.loads(body)})
        except ValueError:
            args = "{}" if not body else body
        out.tool_calls.append(ToolCallDelta(self._calls, new_call_id(), self._recipient[len("functions."):], args))
        self._calls += 1
        self._body = ""
