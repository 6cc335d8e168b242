"""``PreparedRequest`` <-> ``CoreAdd`` (the engine-core protocol), tensors as raw bytes."""

from __future__ import annotations

import torch

from shared.schemas import CoreAdd, CoreSampling, CoreTensor, SamplingParams, StructuredSpec

from ..types import PreparedRequest

_SEED_RANGE = 1 << 63  # msgpack and torch generators take 64-bit seeds; any int maps into range


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
        seed=None if s.seed is None else s.seed % _SEED_RANGE, stop_token_ids=list(s.stop_token_ids),
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
        router_keys=list(prep.router_keys),
    )


def from_core_add(msg: CoreAdd, device: torch.device, dtype: torch.dtype) -> PreparedRequest:
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
    return PreparedRequest(
        request_id=msg.request_id, prompt_ids=list(msg.prompt_ids), sampling=sampling,
        mm_items=[None if t is None else tensor_from_wire(t).to(device=device, dtype=dtype) for t in msg.mm_items],
        mm_spans=[tuple(x) for x in msg.mm_spans], mm_hashes=list(msg.mm_hashes),
        bidirectional=msg.bidirectional, return_logprobs=msg.return_logprobs, top_logprobs=msg.top_logprobs,
        swa_checkpoints=list(msg.swa_checkpoints),
    )
