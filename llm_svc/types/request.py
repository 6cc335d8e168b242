"""Core types of the LLM service, at the bottom of ``llm_svc`` (they import nothing of it):

* ``PreparedRequest``: a validated, tokenized request as the front hands it to a backend;
* ``Request`` / ``RequestStatus`` and the prefix-cache keys of a prompt (``make_prompt_keys``):
  a request as the scheduler tracks it;
* ``SeqForward`` / ``ForwardBatch``: one step's work, the scheduler -> runner contract;
* ``StepOutput``: one sampled token as the scheduler reports it;
* ``GenOutput`` / ``RequestStream`` / ``BackendStats``: what a backend gives the routes.

The scheduler -> runner contract (``SeqForward``, ``ForwardBatch``):
The scheduler decides *what* runs and *where* its KV lives; the runner only executes that.
Everything here is plain Python (ints and lists): the runner turns it into index tensors.

Slot tables live across steps (vLLM's persistent block table): the runner keeps, per request,
the full-pool slot of every position and the SWA-pool slot of every position inside the window
(``llm_svc.attention.slot_tables``). A step sends only what changed: the new tokens' out slots,
appended to the tables, plus a *reset* (the whole table before the new tokens) when the
request's view was created or rewritten (admission, a cached prefix switched to the tree's
slots). A decode step is then O(1) Python per request, whatever its context length.

Attention semantics (same as transformers): a query at absolute position p attends
* in a full-attention layer: keys at positions 0..p,
* in a sliding layer with window W: keys at positions max(0, p-W+1)..p  (W keys incl. itself).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from shared.hashing import content_hash, hash_to_int
from shared.schemas import KVTransferParams, PromptTokenLogprob, SampledLogprob, SamplingParams


# ---------------------------------------------------------------------------- the front's request
@dataclass(frozen=True)
class EmbeddingRef:
    """Where a media item sent by reference can be fetched: ``{source}/v1/embeddings/{key}``
    serves ``[num_tokens, hidden]``; this reference stands for its rows ``start..start+rows``
    (a sub-item: one timestamped run of a video)."""

    key: str
    sources: tuple[str, ...]
    num_tokens: int
    start: int = 0
    length: int | None = None  # None: to the end

    @property
    def rows(self) -> int:
        return self.num_tokens - self.start if self.length is None else self.length

    def part(self, start: int, length: int) -> "EmbeddingRef":
        """The reference to rows ``start..start+length`` of what this one stands for."""
        assert 0 <= start and start + length <= self.rows, (start, length, self.rows)
        return EmbeddingRef(self.key, self.sources, self.num_tokens, self.start + start, length)


@dataclass
class PreparedRequest:
    """Everything a backend needs to run one request.

    ``mm_spans`` are ``(start_position, length, item_index)``; ``mm_items[i]`` is item i's
    embeddings ``[num_tokens, hidden]`` in the model dtype, or None while it is only known by
    reference (``mm_refs[i]``): fetched when a span past the cached prefix needs it.
    """

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stream: bool = False
    mm_items: list[torch.Tensor | None] = field(default_factory=list)
    mm_refs: list[EmbeddingRef | None] = field(default_factory=list)
    mm_spans: list[tuple[int, int, int]] = field(default_factory=list)
    mm_hashes: list[str] = field(default_factory=list)
    bidirectional: bool = False
    return_logprobs: bool = False  # log-probability of each sampled token (raw model distribution)
    top_logprobs: int = 0  # and of its most likely alternatives (with return_logprobs)
    echo_text: str = ""  # completions' ``echo``: the answer's text starts with this (the prompt's)
    system_len: int = 0  # prompt tokens of the leading system message (0: none)
    # positions where later prompts are likely to branch off: their SWA windows are kept for the
    # prefix cache (chosen by the backend from ``system_len`` and its retention settings)
    swa_checkpoints: list[int] = field(default_factory=list)
    # chat: the gateway's router block keys with the prompt tokens each needs (KV events)
    router_keys: list[tuple[int, int]] = field(default_factory=list)
    # chat: splits the text into content, reasoning and tool calls (``llm_svc.front.output_shape``); front only
    shaper: object | None = None
    # prefill / decode disaggregation (docs/disagg.md): what the request asked (front only), and
    # the engine core's part in it (``llm_svc.types.messages.CoreRemote``)
    kv_transfer: KVTransferParams | None = None
    remote: object | None = None

    def __post_init__(self) -> None:
        assert self.prompt_ids, "empty prompt"
        if not self.mm_refs:
            self.mm_refs = [None] * len(self.mm_items)
        assert len(self.mm_refs) == len(self.mm_items)
        for start, length, item in self.mm_spans:
            assert 0 <= start and start + length <= len(self.prompt_ids)
            t, ref = self.mm_items[item], self.mm_refs[item]  # the core's copy has neither until fetched
            assert t is None or t.shape[0] == length
            assert ref is None or ref.rows == length

    def unresolved(self) -> list[int]:
        """Indices of the items known only by reference."""
        return [i for i, t in enumerate(self.mm_items) if t is None]


# ---------------------------------------------------------------------------- the scheduler's request
# Media keys have bit 62 set: they can never equal a token id (< 2**62), and they fit in int64.
MEDIA_KEY_BIT = 1 << 62


def media_key(item_hash: str, row: int) -> int:
    """Stable 63-bit key of row ``row`` of the media item whose content hash is ``item_hash``."""
    h = hash_to_int(content_hash(f"{item_hash}:{row}".encode()))
    return MEDIA_KEY_BIT | (h & (MEDIA_KEY_BIT - 1))


def make_prompt_keys(
    prompt_ids: list[int], mm_spans: list[tuple[int, int, int]], content_hashes: list[str]
) -> list[int]:
    """Prefix-cache keys: ``prompt_ids`` with each media placeholder position replaced by
    ``media_key(content_hashes[item_index], row)``, so equal text with different media never
    shares KV from the first media token on. ``mm_spans``: ``(start_pos, length, item_index)``."""
    keys = list(prompt_ids)
    for start, length, idx in mm_spans:
        if not (0 <= start and start + length <= len(keys)):
            raise ValueError(f"media span {(start, length)} outside a prompt of {len(keys)} tokens")
        for row in range(length):
            keys[start + row] = media_key(content_hashes[idx], row)
    return keys


class RequestStatus(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Mutable request state. ``prompt_keys`` defaults to ``prompt_ids`` (text-only prompts).

    Scheduler-private fields (``kv``, ``num_computed``, ...) are set by the scheduler only.
    ``num_cached_tokens``: prompt tokens served from the prefix cache at first admission.
    """

    req_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prompt_keys: list[int] | None = None
    mm_items: list[Any] = field(default_factory=list)
    mm_spans: list[tuple[int, int, int]] = field(default_factory=list)
    bidirectional: bool = False
    # prompt positions where other requests are likely to branch off (e.g. the end of the system
    # message): the SWA window before each is kept for the prefix cache
    swa_checkpoints: list[int] = field(default_factory=list)
    eos_token_ids: list[int] = field(default_factory=list)
    return_logprobs: bool = False  # log-probability of each sampled token (raw model distribution)
    top_logprobs: int = 0  # and of its most likely alternatives (with return_logprobs)
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    # --- scheduler-private
    kv: Any = None  # llm_svc.kv.SeqKV while running
    num_computed: int = 0  # positions whose KV is written
    num_preemptions: int = 0
    decodes_since_release: int = 0
    admitted_once: bool = False
    prefill_cached: bool = False  # the computed prompt went into the prefix tree (this admission)
    # ``prompt_logprobs`` requests: prompt positions 1..prompt_scored have been scored (in any
    # admission); a prefix-cache hit may cover no more than that (it has no logits)
    prompt_scored: int = 0
    # its admission needs embeddings it has by reference only: not admitted until they arrive
    awaiting_media: bool = False
    # speculative decoding: draft tokens proposed for the next step (set by the engine between
    # steps; the scheduler sends them for verification with the next decode, or drops them)
    spec_tokens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.req_id:
            raise ValueError("req_id must be non-empty")
        if not self.prompt_ids:
            raise ValueError(f"request {self.req_id}: empty prompt")
        if self.prompt_keys is None:
            self.prompt_keys = list(self.prompt_ids)
        if len(self.prompt_keys) != len(self.prompt_ids):
            raise ValueError(f"request {self.req_id}: prompt_keys and prompt_ids lengths differ")
        last_end = 0
        for start, length, idx in sorted(self.mm_spans):
            if length < 1 or start < last_end or start + length > len(self.prompt_ids):
                raise ValueError(f"request {self.req_id}: bad media span {(start, length, idx)}")
            if self.mm_items and not 0 <= idx < len(self.mm_items):
                raise ValueError(f"request {self.req_id}: media span refers to item {idx}")
            last_end = start + length
        if any(not 0 < p <= len(self.prompt_ids) for p in self.swa_checkpoints):
            raise ValueError(f"request {self.req_id}: swa_checkpoints must be in [1, prompt length]")
        assert 0 <= self.num_cached_tokens <= len(self.prompt_ids)
        self.prompt_sig = hash(tuple(self.prompt_keys))  # twins (n > 1, retries) share one prefill

    @property
    def all_ids(self) -> list[int]:
        """Prompt + outputs (a copy: O(context); the step path uses ``token_slice``)."""
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """``all_ids[start:end]`` without building ``all_ids``: O(end - start)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n:end - n]
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[:end - n]

    @property
    def all_keys(self) -> list[int]:
        return self.prompt_keys + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED


# ---------------------------------------------------------------------------- one step
@dataclass
class SeqForward:
    """One sequence's share of a step: a prefill chunk or one decode token.

    ``n = len(token_ids) = len(out_full_slots) = len(out_swa_slots)``; the tokens are at
    positions ``start..end-1`` (``end = start + n``). The runner writes their K/V at
    ``out_*_slots`` and appends those slots to the request's tables. Before that, when
    ``reset_full`` is not None, it replaces the tables: ``reset_full`` holds the full-pool slots
    of positions ``0..start-1`` and ``reset_swa`` the SWA-pool slots of positions
    ``swa_ctx_start..start-1``. Without a reset the runner's tables must already cover exactly
    ``0..start-1``. ``swa_ctx_start = max(0, start - W + 1)``: every SWA slot from there to
    ``end - 1`` holds valid KV once the new tokens are written.
    """

    req_id: str
    token_ids: list[int]
    start: int
    out_full_slots: list[int]
    out_swa_slots: list[int]
    swa_ctx_start: int
    need_logits: bool  # True for the last prefill chunk and for decode steps
    # the logits of every token of the chunk, not only the last (a prefill scoring its prompt)
    all_logits: bool = False
    reset_full: list[int] | None = None
    reset_swa: list[int] | None = None
    # media rows injected at chunk-relative offsets: (offset_in_chunk, row_in_item, item_index)
    mm_rows: list[tuple[int, int, int]] = field(default_factory=list)
    mm_items: list[Any] = field(default_factory=list)  # torch tensors [num_tokens, hidden], owned by the request
    # Gemma 3: tokens of one image attend to each other bidirectionally; spans in absolute positions
    bidirectional_spans: list[tuple[int, int]] = field(default_factory=list)
    # speculative decoding: the last ``num_drafts`` tokens are drafts to verify; the runner returns
    # the logits of the last ``num_drafts + 1`` rows (a decode with need_logits)
    num_drafts: int = 0

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        assert n >= 1 and self.start >= 0
        assert 0 <= self.num_drafts < n and (not self.num_drafts or (self.need_logits and not self.all_logits))
        assert len(self.out_full_slots) == len(self.out_swa_slots) == n
        assert 0 <= self.swa_ctx_start <= self.start
        assert (self.reset_full is None) == (self.reset_swa is None)
        if self.reset_full is not None:
            assert len(self.reset_full) == self.start, (len(self.reset_full), self.start)
            assert len(self.reset_swa) == self.start - self.swa_ctx_start

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def positions(self) -> range:
        return range(self.start, self.end)


@dataclass
class ForwardBatch:
    """All sequences of one engine step, prefill chunks and decodes mixed.

    ``dropped``: requests whose views ended since the previous batch (finished, aborted,
    preempted); the runner frees their tables before applying ``seqs`` (a dropped request may
    come back in ``seqs`` with a reset, e.g. re-admitted after a preemption).
    ``truncated``: requests whose views were cut back since the previous batch (rejected draft
    positions), with the positions they keep: the runner's tables shrink to that length."""

    seqs: list[SeqForward]
    dropped: list[str] = field(default_factory=list)
    truncated: dict[str, int] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass
class StepOutput:
    """One sampled token of a request (``token_id`` None only for a finish without a token)."""

    req_id: str
    token_id: int | None
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int


# ---------------------------------------------------------------------------- backend outputs
@dataclass
class GenOutput:
    """An increment of one request's output; the last one has ``finish_reason`` (or ``error``)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    error_status: int = 500  # HTTP status of ``error``: 4xx the request's fault, 5xx ours
    error_code: str | None = None  # machine-readable kind of ``error`` (e.g. "media_unavailable")
    logprobs: list[float] = field(default_factory=list)  # one per token_ids entry, if requested
    token_logprobs: list[SampledLogprob] = field(default_factory=list)  # the same with texts and alternatives
    prompt_logprobs: list[PromptTokenLogprob] | None = None  # one per prompt token, on one output, if asked

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class RequestStream:
    """Async iterator over one request's ``GenOutput``s, fed from any thread via ``put``;
    ``loop_fed``: every ``put`` runs on ``loop``'s own thread (the engine-core client)."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, loop_fed: bool = False):
        self.request_id = request_id
        self._loop = loop
        self._loop_fed = loop_fed
        self._q: asyncio.Queue[GenOutput] = asyncio.Queue()
        self._done = False

    def put(self, out: GenOutput) -> None:
        """Hand an output to the consumer's event loop (thread-safe unless ``loop_fed``)."""
        if self._loop_fed:  # no self-pipe write and no extra loop turn per token
            self._q.put_nowait(out)
            return
        try:
            self._loop.call_soon_threadsafe(self._q.put_nowait, out)
        except RuntimeError:  # loop closed: the consumer is gone
            pass

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> GenOutput:
        if self._done:
            raise StopAsyncIteration
        out = await self._q.get()
        if out.final:
            self._done = True
        return out

    def ready(self) -> list[GenOutput]:
        """The outputs queued already (up to the final one), taken without waiting."""
        outs = []
        while not self._done and not self._q.empty():
            out = self._q.get_nowait()
            self._done = out.final
            outs.append(out)
        return outs


@dataclass
class BackendStats:
    running: int = 0
    waiting: int = 0
    kv_full_usage: float = 0.0  # fraction of the full-attention KV pool in use
    kv_swa_usage: float = 0.0
    prefix_hit_tokens: int = 0  # cumulative
    engine_restarts: int = 0  # engine-core processes restarted by the front's supervisor
    tiers: dict[str, float] = field(default_factory=dict)  # KV tier counters of the engine core
