"""The chat pipeline (``/v1/chat/completions``, and ``/v1/responses`` once turned into a chat
request), its stages in the order a request walks them, each called once:

1. ``validate``: the checks on the parsed body (before anything may echo a string back);
2. ``load_media``: the prompt checked against the replicas' context, the media parts fetched
   (remote) or decoded (inline), all at once;
3. ``build_prompt``: the media encoded (all items concurrently) and packed with the prompt into
   the LLM's request, one per choice;
4. ``generate`` / ``open_stream``: sent to an LLM replica (the router picks it), by reference
   unless ``media_by_ref`` is off; once again by value if the LLM could not fetch a reference;
5. ``run``: answered (``gateway.pipeline.answer``) as JSON or as SSE (``gateway.pipeline.stream``);
6. the route's ``shape`` and ``writer`` make the protocol's body and events.

The client leaving cancels everything upstream."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response

from gateway.media.items import MediaItem, collect_media
from gateway.openai_api.answer_format import ChunkWriter, CompletionChunkWriter
from gateway.openai_api.request_limits import check_chat_limits
from gateway.openai_api.requests import ChatCompletionRequest
from gateway.openai_api.validate import check_fits, check_template, check_text
from gateway.pipeline.answer import answer
from gateway.pipeline.choices import ChoiceStreams, fan_out, generate_all, open_all, raise_if_aborted
from gateway.pipeline.prompt import build_generate_request, pack_generate
from gateway.state import GatewayState
from gateway.upstream import LLMClient, MediaUnavailable
from shared.schemas import GenerateRequest, GenerateResponse

log = logging.getLogger("mmserve.gateway.chat")
T = TypeVar("T")
Choices = list[tuple[GenerateRequest, bytes]]  # one (request, body) per choice


def validate(state: GatewayState, body: ChatCompletionRequest, *, format_param: str = "response_format") -> None:
    """400 for a string that is not Unicode, a refused ``chat_template_kwargs``, or a named limit
    exceeded (``format_param``: how the request names its structured-output format)."""
    check_text(body)  # before anything may echo a string back
    check_template(body.chat_template_kwargs, state.settings.trust_request_chat_template)
    check_chat_limits(body, state.settings, format_param=format_param)


async def load_media(state: GatewayState, body: ChatCompletionRequest) -> list[MediaItem]:
    """Every media part's bytes, after the text alone was checked against the replicas' context
    (nothing is fetched or encoded for a prompt that cannot fit)."""
    s = state.settings
    check_fits(body, s.default_max_tokens, state.llm_limits.best())  # before any fetch or encode
    refs = collect_media(body, s.max_media_items)
    for ref in refs:
        state.metrics.media_items.labels(ref.modality).inc()
    return await state.fetcher.load(refs, s.max_request_media_bytes)


async def build_prompt(state: GatewayState, body: ChatCompletionRequest, cid: str, items: list[MediaItem],
                       by_ref: bool) -> Choices:
    """The media encoded and packed with the prompt (tensors sent by reference when ``by_ref``,
    else by value), as one request per choice."""
    encoded = await state.encoders.encode_all(items, by_ref=by_ref)
    gen = build_generate_request(body, encoded, cid, state.settings.default_max_tokens)
    packed = pack_generate(gen, encoded)
    for e in encoded:
        state.metrics.media_sent.labels("ref" if e.by_ref else "value").inc()
    state.metrics.llm_body_bytes.inc(len(packed))
    return fan_out(gen, packed, body.n)


async def _send(state: GatewayState, body: ChatCompletionRequest, cid: str,
                send: Callable[[LLMClient, Choices], Awaitable[T]]) -> T:
    """Media, prompt, and the choices sent with ``send``; when the LLM could not fetch what was
    sent by reference (evicted, encoder restarted), encoded again (a cache hit where it is still
    there) and sent by value."""
    items = await load_media(state, body)
    choices = await build_prompt(state, body, cid, items, state.settings.media_by_ref)
    try:  # the LLM answers a by-reference stream's headers once its media is resolved
        return await send(state.llms, choices)
    except MediaUnavailable as e:
        log.info("%s: %s; re-sending the media by value", cid, e.message)
        state.metrics.media_resends.inc()
        choices = await build_prompt(state, body, cid, items, by_ref=False)
        return await send(state.llms, choices)


async def generate(state: GatewayState, body: ChatCompletionRequest, cid: str) -> list[GenerateResponse]:
    """One whole answer per choice (``n``)."""
    resps = await _send(state, body, cid, generate_all)
    raise_if_aborted(resps)
    return resps


async def open_stream(state: GatewayState, body: ChatCompletionRequest, cid: str) -> ChoiceStreams:
    """Every choice's stream, open."""
    return ChoiceStreams(await _send(state, body, cid, open_all))


async def run(request: Request, state: GatewayState, body: ChatCompletionRequest, cid: str, start: float,
              shape: Callable[[list[GenerateResponse]], dict], writer: ChunkWriter | CompletionChunkWriter) -> Response:
    """A validated chat request answered: as JSON, ``shape`` of the choices' answers, or as SSE
    written by ``writer``."""

    async def plain() -> dict:
        return shape(await generate(state, body, cid))

    return await answer(request, state, cid, start, body.stream, plain, lambda: open_stream(state, body, cid), writer)
