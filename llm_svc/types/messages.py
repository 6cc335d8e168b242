"""The engine-core protocol: messages between the LLM service's HTTP front and its engine-core
process, msgspec structs, msgpack-encoded, over ZMQ (a per-token path, so no pydantic here).

Input (front -> core): ``CoreAdd`` / ``CoreAbort`` / ``CoreMedia`` / ``CoreShutdown``; output (core
-> front): ``CoreReady`` / ``CoreOutputs`` / ``CoreFailed``.

Every message carries the ``epoch`` of the core process it is for / from: the front starts
epoch 1, 2, ... on each (re)start and drops anything of an older one, and a core drops input
of another epoch, so nothing of a crashed core leaks into its successor.
"""

from __future__ import annotations

from typing import Union

import msgspec


class CoreTensor(msgspec.Struct, frozen=True):
    """A tensor as raw bytes (row-major): ``dtype`` is a torch dtype name, e.g. ``"float32"``."""

    dtype: str
    shape: list[int]
    data: bytes


class CoreSampling(msgspec.Struct, frozen=True):
    """``SamplingParams`` as the core needs it (already validated by the front)."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    priority: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    min_p: float = 0.0
    structured: tuple[str, str, bool | None] | None = None  # StructuredSpec's (kind, spec, any_whitespace)
    prompt_logprobs: int | None = None


# a prefill replica's finish reason for a request whose rest is decoded on another replica
REMOTE_DECODE = "remote_decode"


class CoreRemote(msgspec.Struct, frozen=True):
    """A request's part in prefill / decode disaggregation (docs/disagg.md). Prefill side:
    ``send_host:send_port``, the decode core the hand-over goes to, under ``transfer_id``. Decode
    side: ``first_token`` (sampled by the prefill replica) and ``transfer_id``, the hand-over to
    continue from; ``finish_reason`` when that token ended the request (nothing to decode);
    ``transfer_id`` empty: no hand-over was made, recompute the prompt."""

    transfer_id: str = ""
    send_host: str = ""
    send_port: int = 0
    first_token: int | None = None
    finish_reason: str | None = None
    first_logprob: float | None = None  # with return_logprobs: the first token's, and its alternatives
    first_top: list[tuple[int, float]] | None = None


class CoreAdd(msgspec.Struct, tag="add"):
    """Start a request: the tokenized prompt with its media embeddings and spans."""

    epoch: int
    request_id: str
    prompt_ids: list[int]
    sampling: CoreSampling
    mm_items: list[CoreTensor | None] = []  # None: by reference, sent later in a CoreMedia
    mm_spans: list[tuple[int, int, int]] = []  # (start_position, length, item_index)
    mm_hashes: list[str] = []
    bidirectional: bool = False
    return_logprobs: bool = False
    swa_checkpoints: list[int] = []  # prompt positions whose SWA windows the prefix cache keeps
    top_logprobs: int = 0
    router_keys: list[tuple[int, int]] = []  # (router block key, prompt tokens it needs): KV events
    remote: CoreRemote | None = None  # prefill / decode disaggregation


class CoreAbort(msgspec.Struct, tag="abort"):
    """Stop requests and free what they hold (unknown ids are ignored)."""

    epoch: int
    request_ids: list[str]


class CoreShutdown(msgspec.Struct, tag="shutdown"):
    epoch: int


class CoreMedia(msgspec.Struct, tag="media"):
    """Embeddings a ``CoreNeed`` asked for: ``(item_index, tensor)`` pairs of one request."""

    epoch: int
    request_id: str
    items: list[tuple[int, CoreTensor]]


CoreInput = Union[CoreAdd, CoreAbort, CoreShutdown, CoreMedia]


class CorePromptLogprob(msgspec.Struct, array_like=True):
    """A prompt position's logprob (``PromptTokenLogprob`` without the texts, which the front
    adds): None for position 0; ``top``: (token id, logprob) of its most likely alternatives."""

    logprob: float | None = None
    rank: int | None = None
    top: list[tuple[int, float]] = []


class CoreToken(msgspec.Struct, array_like=True):
    """One step's result for one request: a sampled token (or none, for a finish without one)
    and, on the last, ``finish_reason``; ``error`` (with ``status``, 4xx or 5xx) fails it.
    ``prompt_logprobs`` (one per prompt position) rides on the request's first output."""

    request_id: str
    token_id: int | None = None
    logprob: float | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_cached_tokens: int = 0
    error: str | None = None
    status: int = 0
    top: list[tuple[int, float]] | None = None  # (token id, logprob) of the top_logprobs alternatives
    prompt_logprobs: list[CorePromptLogprob] | None = None
    code: str | None = None  # with ``error``: its machine-readable code (e.g. ``context_length_exceeded``)


class CoreStats(msgspec.Struct):
    running: int = 0
    waiting: int = 0
    kv_full_usage: float = 0.0
    kv_swa_usage: float = 0.0
    prefix_hit_tokens: int = 0
    steps: int = 0
    tiers: dict[str, float] = {}  # KV tier counters (llm_svc.offload.tiers.KVTiers.metrics)


class CoreNeed(msgspec.Struct, array_like=True):
    """A request's admission found media spans past its cached prefix whose embeddings it was
    sent by reference: the front fetches ``items`` (item indices) and answers a ``CoreMedia``."""

    request_id: str
    items: list[int]


class CoreOutputs(msgspec.Struct, tag="outputs"):
    """What one loop iteration of the core produced; also its heartbeat (``outputs`` may be
    empty). ``stats`` rides along at most a few times a second."""

    epoch: int
    outputs: list[CoreToken] = []
    stats: CoreStats | None = None
    needs: list[CoreNeed] = []
    # KV events: router block keys the prefix tree now holds / no longer holds
    kv_stored: list[int] = []
    kv_removed: list[int] = []


class CoreReady(msgspec.Struct, tag="ready"):
    """The core loaded the model and serves; capacities let the front refuse what never fits."""

    epoch: int
    pid: int
    num_full_slots: int
    num_swa_slots: int
    window: int
    kv_bytes: int
    handover_port: int = 0  # role decode: where hand-overs are received


class CoreFailed(msgspec.Struct, tag="failed"):
    """The core could not start (e.g. the model does not load); it exits after sending this."""

    epoch: int
    error: str


CoreOutput = Union[CoreOutputs, CoreReady, CoreFailed]
