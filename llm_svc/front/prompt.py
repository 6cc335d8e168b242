"""GenerateRequest + media tensors -> a validated, tokenized prompt with media spans."""

from __future__ import annotations

import json

import torch

from shared.chat_template import TemplateKwargsError, check_template_kwargs
from shared.prefix_keys import key_positions, prefix_layout
from shared.schemas import GenerateRequest, PromptMedia, PromptMessage, PromptText

from llm_svc.types.errors import InvalidRequest
from llm_svc.loading.loader import LoadedLM
from .output_shape import build_shaper
from llm_svc.loading.prompt_bound import tokens_past
from .schema_check import check_request_schemas
from .tool_choice import forced_spec
from .tool_tags import auto_spec
from llm_svc.types.request import EmbeddingRef, PreparedRequest

SEED_RANGE = 1 << 63  # every backend's generator takes it (and msgpack, to the engine core)


def render_prompt_ids(lm: LoadedLM, req: GenerateRequest, trust_template: bool = False) -> list[int]:
    """Chat template (one pad token per media item) -> token ids, no extra special tokens."""
    return _tokenize(lm, render_prompt_text(lm, req, trust_template))


def render_prompt_text(lm: LoadedLM, req: GenerateRequest, trust_template: bool = False) -> str:
    """The chat template's text of ``req`` (one pad token per media item). ``trust_template``:
    a template in ``req.chat_template_kwargs`` is rendered (``trust_request_chat_template``)."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools.tools] if req.tools is not None else None
    return _render_text(lm, _template_messages(req), add_generation_prompt=True, tools=tools,
                        kwargs=req.chat_template_kwargs, trust_template=trust_template)


def render_text_ids(lm: LoadedLM, messages: list[PromptMessage], add_generation_prompt: bool,
                    tools: list | None = None, kwargs: dict | None = None, trust_template: bool = False) -> list[int]:
    """Text-only chat ``messages`` (with the request's ``tools`` and template kwargs) through the
    chat template -> token ids (``/tokenize``)."""
    dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    return _render(lm, _template_messages(GenerateRequest(request_id="render", messages=messages)),
                   add_generation_prompt=add_generation_prompt, tools=dicts, kwargs=kwargs,
                   trust_template=trust_template)


def _render(lm: LoadedLM, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None,
            kwargs: dict | None = None, trust_template: bool = False) -> list[int]:
    return _tokenize(lm, _render_text(lm, messages, add_generation_prompt, tools, kwargs, trust_template))


def _tokenize(lm: LoadedLM, text: str, add_special_tokens: bool = False) -> list[int]:
    return list(lm.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def _render_text(lm: LoadedLM, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None,
                 kwargs: dict | None = None, trust_template: bool = False) -> str:
    # every render passes here: a request's own template is never rendered unless trusted
    try:
        check_template_kwargs(kwargs, trust_template)
    except TemplateKwargsError as e:
        raise InvalidRequest(str(e), param="chat_template_kwargs") from None
    try:
        text = lm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                tools=tools or None, **(kwargs or {}))
    except Exception as e:  # jinja's own errors (a template's raise_exception): the request's fault
        if type(e).__name__ not in ("TemplateError", "TemplateSyntaxError", "UndefinedError", "TypeError"):
            raise
        raise InvalidRequest(f"the model's chat template refused these messages: {str(e)[:300]}",
                             param="messages") from None
    return text


def system_prefix_len(lm: LoadedLM, req: GenerateRequest, ids: list[int]) -> int:
    """Tokens of ``ids`` that the leading text-only system message renders to (0 if none): where
    other conversations with the same system prompt branch off."""
    first = req.messages[0] if req.messages else None
    if first is None or first.role != "system" or len(req.messages) < 2:
        return 0
    if not all(isinstance(p, PromptText) for p in first.content):
        return 0
    try:
        sys_ids = _render(lm, _template_messages(req)[:1], add_generation_prompt=False)
    except Exception:  # a template that refuses a lone system message
        return 0
    n = 0
    for a, b in zip(sys_ids, ids):
        if a != b:
            break
        n += 1
    return n if n < len(ids) else 0


def _template_messages(req: GenerateRequest) -> list[dict]:
    messages = []
    for m in req.messages:
        parts = []
        for p in m.content:
            if isinstance(p, PromptText):
                parts.append({"type": "text", "text": p.text})
            else:
                parts.append({"type": p.modality})
        msg: dict = {"role": m.role, "content": parts}
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                 for c in m.tool_calls]
            if not parts:
                msg["content"] = ""  # templates test ``content`` as a string before the calls
        for key in ("tool_call_id", "name", "reasoning_content"):
            if getattr(m, key) is not None:
                msg[key] = getattr(m, key)
        messages.append(msg)
    return messages


def _arguments(text: str):
    """A tool call's JSON arguments as templates iterate them (a dict), or the text if not JSON
    (vLLM does the same)."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _check_tensor(lm: LoadedLM, part: PromptMedia, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    name = f"mm.{part.index}"
    t = tensors.get(name)
    if t is None:
        raise InvalidRequest(f"media item {part.index} has no tensor {name!r} in the body", param=name)
    if t.ndim != 2:
        raise InvalidRequest(f"tensor {name!r} must be 2-D [num_tokens, hidden], got shape {list(t.shape)}", param=name)
    if t.shape[0] != part.num_tokens:
        raise InvalidRequest(
            f"tensor {name!r} has {t.shape[0]} rows but the prompt says num_tokens={part.num_tokens}", param=name
        )
    if t.shape[1] != lm.hidden_size:
        raise InvalidRequest(
            f"tensor {name!r} has hidden size {t.shape[1]}; this model needs {lm.hidden_size}", param=name
        )
    if not t.is_floating_point():
        raise InvalidRequest(f"tensor {name!r} must be floating point, got {t.dtype}", param=name)
    if not bool(torch.isfinite(t).all()):
        raise InvalidRequest(f"tensor {name!r} contains NaN or Inf", param=name)
    return t.to(device=lm.device, dtype=lm.dtype)


def check_length(tokens: int, max_tokens: int, max_model_len: int, param: str, at_least: bool = False,
                 text_bytes: int | None = None) -> None:
    """400 ``context_length_exceeded`` when the prompt's ``tokens`` (a lower bound when
    ``at_least``) and ``max_tokens`` exceed ``max_model_len``: the front's one rule of a request's
    length, applied as soon as each count is known (from the text's bytes, while tokenizing, and
    exactly once media are expanded). What the KV pools can hold is the scheduler's check."""
    if tokens + max_tokens <= max_model_len:
        return
    count = f"at least {tokens}" if at_least else str(tokens)
    of_text = f" ({text_bytes} bytes of text)" if text_bytes is not None else ""
    raise InvalidRequest(
        f"the prompt has {count} tokens{of_text} and max_tokens is {max_tokens}: together they exceed "
        f"max_model_len={max_model_len}; shorten the prompt or lower max_tokens", param=param,
        code="context_length_exceeded")


def prepare_request(
    lm: LoadedLM, req: GenerateRequest, tensors: dict[str, torch.Tensor], max_model_len: int,
    trust_template: bool = False,
) -> PreparedRequest:
    """Validate ``req`` against the model and expand each media pad into ``num_tokens`` pads
    (``trust_template``: a request's own chat template is rendered, see ``shared.chat_template``).

    Raises ``InvalidRequest`` (-> HTTP 400) with a message that says what to fix.
    """
    s = req.sampling
    if s.seed is not None and not 0 <= s.seed < SEED_RANGE:  # JSON ints are unbounded, generators are not
        s = s.model_copy(update={"seed": s.seed % SEED_RANGE})
    # refuse what cannot fit before rendering and tokenizing it (an 8 MB prompt takes seconds)
    text_bytes = sum(len(p.text.encode("utf-8", "replace")) for m in req.messages for p in m.content
                     if isinstance(p, PromptText)) + len((req.prompt or "").encode("utf-8", "replace"))
    check_length(lm.min_tokens(text_bytes) + len(req.prompt_ids or ()), s.max_tokens, max_model_len, "messages",
                 at_least=True, text_bytes=text_bytes)
    check_request_schemas(s.structured, req.tools)
    if req.tools is not None:
        forced = forced_spec(req.tools) or auto_spec(
            lm.arch, req.tools, s.structured, _thinking(req),
            set(lm.tokenizer.convert_ids_to_tokens(list(lm.eos_token_ids))))
        if forced is not None:
            s = s.model_copy(update={"structured": forced})
    media = [p for m in req.messages for p in m.content if isinstance(p, PromptMedia)]
    supported = sorted(lm.pad_ids)
    for p in media:
        if p.modality not in lm.pad_ids:
            raise InvalidRequest(
                f"this model does not accept {p.modality} input (supported: {supported or 'text only'})",
                param="messages",
            )
    expected = {f"mm.{p.index}" for p in media}
    extra = sorted(set(tensors) - expected)
    if extra:
        raise InvalidRequest(f"body has tensors {extra} that no media part refers to", param="body")
    # an item without a tensor but with sources is by reference: fetched only if needed
    refs = {p.index: EmbeddingRef(p.key, tuple(p.sources), p.num_tokens)
            for p in media if p.sources and f"mm.{p.index}" not in tensors}
    items = {p.index: None if p.index in refs else _check_tensor(lm, p, tensors) for p in media}

    bad = [t for t in s.stop_token_ids if not 0 <= t < lm.vocab_size]
    if bad:
        raise InvalidRequest(f"stop_token_ids {bad} are outside the vocabulary [0, {lm.vocab_size})",
                             param="stop_token_ids")
    bad = sorted(t for t in s.logit_bias if not 0 <= t < lm.vocab_size)
    if bad:
        raise InvalidRequest(f"logit_bias token ids {bad[:10]} are outside the vocabulary [0, {lm.vocab_size})",
                             param="logit_bias")

    if req.prompt_ids is not None:
        bad = sorted({t for t in req.prompt_ids if not 0 <= t < lm.vocab_size})
        if bad:
            raise InvalidRequest(f"prompt token ids {bad[:10]} are outside the vocabulary [0, {lm.vocab_size})",
                                 param="prompt")
        ids = list(req.prompt_ids)
    else:  # completions: the tokenizer's own special tokens, as vLLM; chat: the template's alone
        specials = req.prompt is not None
        text = req.prompt if specials else render_prompt_text(lm, req, trust_template)
        # a text that cannot fit is refused once that is certain, not after tokenizing all of it
        at_least = tokens_past(lm.tokenizer, lm.bound, text, max_model_len - s.max_tokens, specials)
        if at_least is not None:
            check_length(at_least, s.max_tokens, max_model_len, "prompt" if specials else "messages", at_least=True)
        ids = _tokenize(lm, text, specials)
    if not ids:
        raise InvalidRequest("the prompt renders to no tokens; send some text", param="prompt")
    out, spans, mm_items, mm_refs, mm_hashes, item_spans = _expand_media(lm, ids, media, items, refs)
    check_length(len(out), s.max_tokens, max_model_len, "max_tokens")
    system_len = system_prefix_len(lm, req, ids) if not spans or spans[0][0] > 0 else 0
    return PreparedRequest(
        request_id=req.request_id,
        prompt_ids=out,
        sampling=s,
        stream=req.stream,
        mm_items=mm_items,
        mm_refs=mm_refs,
        mm_spans=spans,
        mm_hashes=mm_hashes,
        bidirectional=lm.bidirectional_media and bool(spans),
        return_logprobs=req.return_logprobs or req.top_logprobs > 0,
        top_logprobs=req.top_logprobs,
        echo_text=(req.prompt if req.prompt is not None else lm.tokenizer.decode(req.prompt_ids or [])) if req.echo else "",
        system_len=system_len,
        router_keys=key_positions(prefix_layout(req.messages), len(out), item_spans, system_len) if req.messages else [],
        shaper=build_shaper(lm, req),
        kv_transfer=req.kv_transfer_params,
    )


def _expand_media(lm: LoadedLM, ids: list[int], media: list[PromptMedia], items: dict[int, torch.Tensor | None],
                  refs: dict[int, EmbeddingRef]):
    """Each media pad -> ``num_tokens`` pads (or the item's timestamped layout). Returns the ids,
    the spans ``(start, length, sub_item)``, the sub-items (one per pad run: a timestamped video
    has one per temporal group; None for an item by reference), their references (the rows of
    the item each stands for), their prefix-cache hashes, and one span ``(start, length, item)``
    per media item (a timestamped video's whole layout: what the router keys see as one item)."""
    pad_set = set(lm.pad_ids.values())
    out: list[int] = []
    spans: list[tuple[int, int, int]] = []
    mm_items: list[torch.Tensor | None] = []
    mm_refs: list[EmbeddingRef | None] = []
    mm_hashes: list[str] = []
    item_spans: list[tuple[int, int, int]] = []
    k, i = 0, 0
    while i < len(ids):
        tid = ids[i]
        i += 1
        if tid not in pad_set:
            out.append(tid)
            continue
        if k >= len(media) or lm.pad_ids[media[k].modality] != tid:
            raise InvalidRequest("the text contains a media placeholder token; remove it", param="messages")
        part = media[k]
        k += 1
        # the media key (content + encoder model + preprocessing) keys the prefix cache when known
        base = part.key or part.content_hash
        layout = lm.layouts.get(part.modality)
        if layout is None:
            spans.append((len(out), part.num_tokens, len(mm_items)))
            item_spans.append((len(out), part.num_tokens, part.index))
            out.extend([tid] * part.num_tokens)
            mm_items.append(items[part.index])
            mm_refs.append(refs.get(part.index))
            mm_hashes.append(base)
            continue
        if part.segments is None:
            raise InvalidRequest(f"media item {part.index} ({part.modality}) needs its timestamped segments for this "
                                 "model; encode it with this model's encoder", param="messages")
        if not (out and out[-1] == layout.start and i < len(ids) and ids[i] == layout.end):
            raise InvalidRequest(f"the chat template does not wrap the {part.modality} placeholder in its start/end "
                                 "tokens", param="messages")
        out.pop()  # the template's start + pad + end become the timestamped layout
        i += 1
        rendered, runs = layout.render(lm.tokenizer, part.segments)
        row = 0
        whole, ref = items[part.index], refs.get(part.index)
        for j, (off, n) in enumerate(runs):
            spans.append((len(out) + off, n, len(mm_items)))
            mm_items.append(None if whole is None else whole[row : row + n])
            mm_refs.append(None if ref is None else ref.part(row, n))
            mm_hashes.append(f"{base}/t{j}")
            row += n
        item_spans.append((len(out), len(rendered), part.index))
        out.extend(rendered)
    if k != len(media):
        raise InvalidRequest(
            f"the chat template placed {k} media placeholders for {len(media)} media parts", param="messages"
        )
    return out, spans, mm_items, mm_refs, mm_hashes, item_spans


def _thinking(req: GenerateRequest) -> bool | None:
    """The request's ``enable_thinking`` as the templates test it (``is true`` / ``is false``)."""
    value = (req.chat_template_kwargs or {}).get("enable_thinking")
    return value if isinstance(value, bool) else None
