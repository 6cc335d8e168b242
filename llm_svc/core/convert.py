"""``PreparedRequest`` -> ``CoreAdd`` (the engine-core protocol, tensors as raw bytes) -> the
engine's ``Request``: the one way into an engine, for the engine-core process and the in-process
engine alike. Nothing is checked here: the front validated the request (token counts, ids, the
seed's range) and the scheduler checks what only it knows (that it can ever fit the KV pools)."""

from __future__ import annotations

import torch

from llm_svc.types.messages import CoreAdd, CoreSampling, CoreTensor
from shared.schemas import SamplingParams, StructuredSpec

from llm_svc.types.request import PreparedRequest, Request, make_prompt_keys


def tensor_to_wire(t: torch.Tensor) -> CoreTensor:
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: ship the raw 16-bit words
        data = t.view(torch.int16).numpy().tobytes()
    else:
        data = t.numpy().tobytes()
    return CoreTensor(str(t.dtype).removeprefix("torch."), list(t.shape), data)


def tensor_from_wire(w: CoreTensor) -> torch.Tensor:
    dtype = getattr(torch, w.dtype)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {w.dtype!r}")
    flat = torch.frombuffer(bytearray(w.data), dtype=dtype) if w.data else torch.empty(0, dtype=dtype)
    return flat.reshape(w.shape)


def to_core_add(prep: PreparedRequest, epoch: int, request_id: str | None = None) -> CoreAdd:
    """``prep`` as the core's message; ``request_id``: the id the core knows it by."""
    s = prep.sampling
    sampling = CoreSampling(
        max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
        seed=s.seed, stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos, min_tokens=s.min_tokens, priority=s.priority,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty, logit_bias=dict(s.logit_bias), min_p=s.min_p,
        structured=None if s.structured is None else (s.structured.kind, s.structured.spec, s.structured.any_whitespace),
        prompt_logprobs=s.prompt_logprobs,
    )
    return CoreAdd(
        epoch=epoch, request_id=prep.request_id if request_id is None else request_id, prompt_ids=list(prep.prompt_ids), sampling=sampling,
        mm_items=[None if t is None else tensor_to_wire(t) for t in prep.mm_items],
        mm_spans=[tuple(x) for x in prep.mm_spans],
        mm_hashes=list(prep.mm_hashes), bidirectional=prep.bidirectional, return_logprobs=prep.return_logprobs,
        swa_checkpoints=list(prep.swa_checkpoints), top_logprobs=prep.top_logprobs,
        router_keys=list(prep.router_keys), remote=prep.remote,
    )


def request_from_core(msg: CoreAdd, device: torch.device, dtype: torch.dtype | None,
                      eos_token_ids: list[int]) -> Request:
    """The engine's ``Request`` for ``msg``: media moved to ``device`` (cast to ``dtype``, the
    model's; None keeps the sender's), swa checkpoints past the prompt dropped."""
    s = msg.sampling
    sampling = SamplingParams.model_construct(
        max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed,
        stop=[], stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
        min_tokens=s.min_tokens, priority=s.priority, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, repetition_penalty=s.repetition_penalty,
        logit_bias=dict(s.logit_bias), min_p=s.min_p,
        structured=None if s.structured is None else StructuredSpec.model_construct(
            kind=s.structured[0], spec=s.structured[1], any_whitespace=s.structured[2]),
        prompt_logprobs=s.prompt_logprobs,
    )
    prompt_ids = list(msg.prompt_ids)
    spans = [tuple(x) for x in msg.mm_spans]
    return Request(
        req_id=msg.request_id, prompt_ids=prompt_ids, sampling=sampling,
        prompt_keys=make_prompt_keys(prompt_ids, spans, msg.mm_hashes),
        mm_items=[None if t is None else tensor_from_wire(t).to(device=device, dtype=dtype) for t in msg.mm_items],
        mm_spans=spans, bidirectional=msg.bidirectional,
        swa_checkpoints=[c for c in msg.swa_checkpoints if 0 < c <= len(prompt_ids)],
        eos_token_ids=eos_token_ids, return_logprobs=msg.return_logprobs, top_logprobs=msg.top_logprobs,
    )
