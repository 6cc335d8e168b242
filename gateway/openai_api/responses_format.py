"""The Responses API on top of chat: a ``ResponsesRequest`` as a ``ChatCompletionRequest`` (input
items as messages), and our answers as Responses objects and stream events.

Logprobs (``include: ["message.output_text.logprobs"]`` or ``top_logprobs`` > 0): every generated
token's, on the message's ``output_text`` (as chat's ``logprobs`` and vLLM's) and, streamed, on
the ``output_text.delta`` events (a token that adds no text rides on the next delta; a last
delta without text carries what is left), so that they concatenate to the done event's.

Input items: ``{"role", "content"}`` messages (``content`` a string or ``input_text`` /
``input_image`` / ``output_text`` / an assistant's ``refusal`` parts), ``function_call`` items
(assistant tool calls, merged into one assistant turn), ``function_call_output`` items (tool turns;
``output`` a string or parts) and ``reasoning`` items (their text is the next assistant turn's
``reasoning_content``). Any other item, part or field is a 400 naming it (``input[2].content[0].file_id``),
but for the no-ops of ``gateway.openai_api.responses_api.RESPONSES_ITEM_NOOP_FIELDS``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from gateway.openai_api.requests import ChatCompletionRequest
from gateway.openai_api.responses_api import RESPONSES_ITEM_NOOP_FIELDS, RESPONSES_ITEM_UNSUPPORTED, ResponsesRequest
from gateway.openai_api.answer_format import assistant_message
from shared.schemas import GenerateResponse, SampledLogprob, ToolCallWire


class InputError(ValueError):
    """An input item this server cannot take: ``param`` is where (``input[2].content[0].file_id``),
    the message says why."""

    def __init__(self, param: str, why: str) -> None:
        super().__init__(f"{param}: {why}")
        self.param = param


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# item / part type -> the fields read (besides ``type``); RESPONSES_ITEM_NOOP_FIELDS are ignored,
# RESPONSES_ITEM_UNSUPPORTED pass at their defaults, any other field is a 400 naming it
_ITEMS = {"message": {"role", "content"}, "function_call": {"call_id", "id", "name", "arguments"},
          "function_call_output": {"call_id", "name", "output"}, "reasoning": {"summary", "content"}}
_PARTS = {"input_text": {"text"}, "output_text": {"text"}, "text": {"text"}, "input_image": {"image_url"},
          "refusal": {"refusal"}}
_PART_REFUSED = {"input_file": "file parts are not served (send images as input_image)",
                 "refusal": "refusal parts belong to assistant messages"}


def _check_fields(obj: dict, kind: str, where: str) -> None:
    read = _ITEMS.get(kind) or _PARTS[kind]
    for name, value in obj.items():
        key = f"{kind}.{name}"
        if name == "type" or name in read or key in RESPONSES_ITEM_NOOP_FIELDS:
            continue
        allowed, why = RESPONSES_ITEM_UNSUPPORTED.get(key, ((), f"not a field of {kind} here; remove it"))
        if value not in allowed:
            raise InputError(f"{where}.{name}", why)


def _parts(content: Any, where: str, role: str) -> str | list[dict]:
    """Content (``where``: ``input[2].content``) as chat's: a string, or text and image_url parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InputError(where, "a string or a list of parts")
    out = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        kind = kind if isinstance(kind, str) else None  # a list or object type names nothing
        if kind not in _PARTS or kind == "refusal" and role != "assistant":
            why = _PART_REFUSED.get(kind, f"part type {kind!r} is not served")
            raise InputError(f"{where}[{j}].type", f"{why}; this server takes input_text, input_image, output_text "
                             "and (an assistant's) refusal parts")
        _check_fields(p, kind, f"{where}[{j}]")
        if kind == "input_image":
            if not isinstance(p.get("image_url"), str):
                raise InputError(f"{where}[{j}].image_url", "input_image needs an image_url (a URL or data: URL)")
            out.append({"type": "image_url", "image_url": {"url": p["image_url"]}})
        else:  # an assistant's refusal is its text, as in chat
            out.append({"type": "text", "text": p.get("refusal" if kind == "refusal" else "text", "")})
    return out


def _reasoning_text(it: dict, where: str) -> str:
    texts = []
    for key in ("content", "summary"):
        for k, c in enumerate(it.get(key) or ()):
            extra = sorted(set(c) - {"type", "text"}) if isinstance(c, dict) else ["text"]
            if extra:
                raise InputError(f"{where}.{key}[{k}].{extra[0]}", "a reasoning part has a type and a text only")
            texts.append(c.get("text", ""))
    return "".join(texts)


def _messages(req: ResponsesRequest) -> list[dict]:
    """The input items as chat messages (an ``InputError`` names a field this server would ignore)."""
    messages: list[dict] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    reasoning: str | None = None
    for i, it in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(it, dict):
            raise InputError(where, "an item is an object")
        kind = it.get("type") or ("message" if "role" in it else "item_reference")
        if not isinstance(kind, str):
            raise InputError(f"{where}.type", "an item's type must be a string")
        if kind not in _ITEMS:
            why = (f"{kind!r} items need stored items; send the items themselves" if kind == "item_reference"
                   else f"item type {kind!r} is not served")
            raise InputError(f"{where}.type", f"{why} (message, function_call, function_call_output, reasoning)")
        _check_fields(it, kind, where)
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InputError(f"{where}.role", "user, assistant, system or developer")
            msg = {"role": role, "content": _parts(it.get("content", ""), f"{where}.content", role)}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            messages.append(msg)
        elif kind == "function_call":
            call = {"id": it.get("call_id") or it.get("id") or _id("call"), "type": "function",
                    "function": {"name": it.get("name", ""), "arguments": it.get("arguments", "{}")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                msg = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning is not None:
                    msg["reasoning_content"], reasoning = reasoning, None
                messages.append(msg)
        elif kind == "function_call_output":
            msg = {"role": "tool", "tool_call_id": it.get("call_id", ""),
                   "content": _parts(it.get("output", ""), f"{where}.output", "tool")}
            if it.get("name") is not None:
                msg["name"] = it["name"]
            messages.append(msg)
        else:
            reasoning = _reasoning_text(it, where)
    return messages


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The same request as chat (raises ``InputError`` or pydantic's ValueError for a bad one)."""
    messages = _messages(req)
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream}
    if req.stream:
        body["stream_options"] = {"include_usage": True}  # response.completed carries the usage
    for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                     ("seed", "seed"), ("top_k", "top_k"), ("min_p", "min_p"),
                     ("repetition_penalty", "repetition_penalty"), ("parallel_tool_calls", "parallel_tool_calls")):
        if getattr(req, src) is not None:
            body[dst] = getattr(req, src)
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    if req.tool_choice is not None:
        tc = req.tool_choice
        body["tool_choice"] = tc if isinstance(tc, str) else {"type": "function", "function": {"name": tc.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "response", "description": fmt.description, "schema": fmt.schema_ or {},
            "strict": fmt.strict}}
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    if req.wants_logprobs():
        body["logprobs"], body["top_logprobs"] = True, req.top_logprobs or 0
    return ChatCompletionRequest.model_validate(body)


def _usage(prompt: int, completion: int, cached: int) -> dict:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def _message_item(text: str, mid: str, status: str = "completed", logprobs: list[dict] | None = None) -> dict:
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def _logprobs(entries: list[SampledLogprob], with_bytes: bool) -> list[dict]:
    """Tokens' logprobs in the Responses shape: ``output_text`` parts carry each token's UTF-8
    ``bytes``, the stream events' logprobs do not."""
    def one(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, **({"bytes": list(token.encode())} if with_bytes else {})}

    return [{**one(e.token, e.logprob), "top_logprobs": [one(a.token, a.logprob) for a in e.top]} for e in entries]


def _call_item(c: ToolCallWire, status: str = "completed") -> dict:
    return {"type": "function_call", "id": _id("fc"), "call_id": c.id, "name": c.name,
            "arguments": c.arguments or "{}", "status": status}


def _reasoning_item(text: str) -> dict:
    return {"type": "reasoning", "id": _id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


class ResponseShell:
    """What every Responses object of one request repeats: ids, the request's settings echoed."""

    def __init__(self, req: ResponsesRequest, created: int) -> None:
        self.id, self.created, self.req = _id("resp"), created, req

    def body(self, status: str, output: list[dict], usage: dict | None, incomplete: str | None = None) -> dict:
        r = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": r.model,
            "output": output, "usage": usage, "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": r.instructions, "metadata": r.metadata or {},
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "tool_choice": "auto" if r.tool_choice is None else r.tool_choice if isinstance(r.tool_choice, str)
            else r.tool_choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or ()],
            "temperature": r.temperature, "top_p": r.top_p, "max_output_tokens": r.max_output_tokens,
            "top_logprobs": r.top_logprobs,
            "text": (r.text.model_dump(by_alias=True, exclude_none=True) if r.text else {"format": {"type": "text"}}),
            "truncation": "disabled", "store": False, "previous_response_id": None, "reasoning": None,
            "user": r.user,
        }


def response_object(shell: ResponseShell, resp: GenerateResponse) -> dict:
    """A whole (non-streamed) answer: reasoning, the message, then the function calls."""
    msg = assistant_message(resp)
    output: list[dict] = []
    if msg.reasoning:
        output.append(_reasoning_item(msg.reasoning))
    if msg.content:
        lps = _logprobs(resp.token_logprobs or [], with_bytes=True) if shell.req.wants_logprobs() else None
        output.append(_message_item(msg.content, _id("msg"), logprobs=lps))
    output.extend(_call_item(ToolCallWire(index=i, id=c.id, name=c.function.name, arguments=c.function.arguments))
                  for i, c in enumerate(msg.tool_calls or ()))
    incomplete = "max_output_tokens" if resp.finish_reason == "length" else None
    return shell.body("incomplete" if incomplete else "completed", output,
                      _usage(resp.prompt_tokens, resp.completion_tokens, resp.cached_tokens), incomplete)


def sse_event(payload: dict) -> bytes:
    return (f"event: {payload['type']}\n".encode() + b"data: "
            + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")


class ResponsesEventWriter:
    """The Responses stream's events, driven by ``gateway.pipeline.stream.sse_events`` like the chat
    writers: created / in_progress; then items as they arrive, each with the next
    ``output_index``: the reasoning so far (whole) before the first other item, the message
    (output_item.added, content_part.added, output_text.delta ...) and each function call
    (output_item.added with its name, function_call_arguments.delta per arguments piece, as the
    parser sends them); at the finish the done events of each open item; usage -> completed."""

    include_usage = True

    def __init__(self, shell: ResponseShell) -> None:
        self.shell = shell
        self.seq = 0
        self.output: list[dict] = []  # every item announced, by output_index
        self.text: str | None = None  # the message's text (None: no message yet)
        self.msg_pos = -1
        self.msg_id = _id("msg")
        self.reasoning = ""  # reasoning not yet sent as an item
        self.calls: dict[int, int] = {}  # call index -> output_index
        self.finish_reason: str | None = None
        self.logprobs = shell.req.wants_logprobs()
        self.entries: list[SampledLogprob] = []  # every token's logprobs so far (when asked)
        self.unsent = 0  # the last entries not yet on a delta event

    def _ev(self, payload: dict) -> bytes:
        payload["sequence_number"] = self.seq
        self.seq += 1
        return sse_event(payload)

    def _add(self, item: dict, added: dict | None = None) -> bytes:
        """Announce ``item`` at the next output_index (``added``: how it shows while open)."""
        out = self._flush_reasoning() if item["type"] != "reasoning" else b""
        self.output.append(item)
        return out + self._ev({"type": "response.output_item.added", "output_index": len(self.output) - 1,
                               "item": added or item})

    def _flush_reasoning(self) -> bytes:
        if not self.reasoning:
            return b""
        item, self.reasoning = _reasoning_item(self.reasoning), ""
        out = self._add(item)
        return out + self._ev({"type": "response.output_item.done", "output_index": len(self.output) - 1, "item": item})

    def opening(self, index: int = 0) -> list[bytes]:
        body = self.shell.body("in_progress", [], None)
        return [self._ev({"type": "response.created", "response": body}),
                self._ev({"type": "response.in_progress", "response": body})]

    def _delta(self, text: str) -> bytes:
        lps = _logprobs(self.entries[len(self.entries) - self.unsent:], with_bytes=False) if self.unsent else []
        self.unsent = 0
        return self._ev({"type": "response.output_text.delta", "item_id": self.msg_id, "output_index": self.msg_pos,
                         "content_index": 0, "delta": text, "logprobs": lps})

    def content(self, text: str, logprobs=None, reasoning: str | None = None,
                tool_calls: list[ToolCallWire] | None = None, index: int = 0, prompt_logprobs=None) -> bytes:
        out = b""
        if self.logprobs and logprobs:
            self.entries += logprobs
            self.unsent += len(logprobs)
        if reasoning:
            self.reasoning += reasoning
        if text:
            if self.text is None:
                self.text = ""
                out += self._add(_message_item("", self.msg_id, "in_progress"),
                                 _message_item("", self.msg_id, "in_progress") | {"content": []})
                self.msg_pos = len(self.output) - 1
                out += self._ev({"type": "response.content_part.added", "item_id": self.msg_id,
                                 "output_index": self.msg_pos, "content_index": 0,
                                 "part": {"type": "output_text", "text": "", "annotations": []}})
            self.text += text
            out += self._delta(text)
        for c in tool_calls or ():
            if c.index not in self.calls:
                out += self._add(_call_item(c, "in_progress") | {"arguments": ""})
                self.calls[c.index] = len(self.output) - 1
            pos = self.calls[c.index]
            if c.arguments:
                self.output[pos]["arguments"] += c.arguments
                out += self._ev({"type": "response.function_call_arguments.delta", "item_id": self.output[pos]["id"],
                                 "output_index": pos, "delta": c.arguments})
        return out

    def finish(self, reason: str, index: int = 0) -> bytes:
        self.finish_reason = reason
        out = self._flush_reasoning()
        for pos, item in enumerate(self.output):
            if item.get("status") != "in_progress":
                continue
            if item["type"] == "message":
                if self.unsent:
                    out += self._delta("")
                item.update(_message_item(self.text, self.msg_id, logprobs=_logprobs(self.entries, with_bytes=True)))
                out += self._ev({"type": "response.output_text.done", "item_id": self.msg_id, "output_index": pos,
                                 "content_index": 0, "text": self.text,
                                 "logprobs": _logprobs(self.entries, with_bytes=False)})
                out += self._ev({"type": "response.content_part.done", "item_id": self.msg_id, "output_index": pos,
                                 "content_index": 0, "part": item["content"][0]})
            else:
                item.update(status="completed", arguments=item["arguments"] or "{}")
                out += self._ev({"type": "response.function_call_arguments.done", "item_id": item["id"],
                                 "output_index": pos, "arguments": item["arguments"]})
            out += self._ev({"type": "response.output_item.done", "output_index": pos, "item": item})
        return out

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> bytes:
        incomplete = "max_output_tokens" if self.finish_reason == "length" else None
        body = self.shell.body("incomplete" if incomplete else "completed", self.output,
                               _usage(prompt_tokens, completion_tokens, cached_tokens), incomplete)
        return self._ev({"type": "response.incomplete" if incomplete else "response.completed", "response": body})

    def error(self, message: str, type: str = "upstream_error") -> bytes:
        return self._ev({"type": "error", "code": type, "message": message, "param": None})
