"""The text-completions pipeline (``/v1/completions``): one LLM request per prompt of the batch
(text or token ids, checked against the replicas' context before anything is sent), ``n``
choices each, answered as JSON or as SSE (``gateway.pipeline.answer``)."""

from __future__ import annotations

import asyncio

from gateway.openai_api.requests import CompletionRequest
from gateway.openai_api.validate import check_context
from gateway.pipeline.choices import ChoiceStreams, fan_out, generate_all, open_all, raise_if_aborted
from gateway.pipeline.prompt import sampling_params
from gateway.state import GatewayState
from shared.rawwire import pack_raw
from shared.schemas import GenerateRequest, GenerateResponse


def generate_request(state: GatewayState, body: CompletionRequest, prompt: str | list[int],
                     rid: str) -> GenerateRequest:
    """One prompt's LLM request; 400 when it cannot fit the replicas' context."""
    limits = state.llm_limits.best()
    sp = sampling_params(body, state.settings.default_max_tokens)
    if limits is not None:  # refuse what cannot fit before anything is sent (the replica checks exactly)
        at_least = len(prompt) if isinstance(prompt, list) else len(prompt.encode("utf-8")) // limits.max_token_bytes
        check_context(at_least, sp.max_tokens, limits, "prompt")
    return GenerateRequest(
        request_id=rid, sampling=sp, stream=body.stream, echo=body.echo,
        prompt=prompt if isinstance(prompt, str) else None, prompt_ids=prompt if isinstance(prompt, list) else None,
        return_logprobs=body.logprobs is not None, top_logprobs=body.logprobs or 0,
    )


def generate_requests(state: GatewayState, body: CompletionRequest, cid: str) -> list[GenerateRequest]:
    """Every prompt's LLM request, prompt ``i`` as ``{cid}-{i}``."""
    return [generate_request(state, body, p, f"{cid}-{i}") for i, p in enumerate(body.prompts())]


async def _one(state: GatewayState, gen: GenerateRequest, n: int) -> list[GenerateResponse]:
    """The ``n`` choices of one prompt."""
    resps = await generate_all(state.llms, fan_out(gen, pack_raw({}, gen), n))
    raise_if_aborted(resps)
    return resps


async def generate(state: GatewayState, gens: list[GenerateRequest], n: int) -> list[GenerateResponse]:
    """Every prompt's ``n`` choices, all prompts at once, in prompt order."""
    per_prompt = await asyncio.gather(*(_one(state, g, n) for g in gens))
    return [r for rs in per_prompt for r in rs]


async def open_stream(state: GatewayState, gen: GenerateRequest, n: int) -> ChoiceStreams:
    """The ``n`` choices' streams of one prompt, open."""
    return ChoiceStreams(await open_all(state.llms, fan_out(gen, pack_raw({}, gen), n)))
