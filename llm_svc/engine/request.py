"""A generation request as the scheduler tracks it, and the prefix-cache keys of its prompt."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from shared.hashing import content_hash, hash_to_int
from shared.schemas import SamplingParams

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

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def all_keys(self) -> list[int]:
        return self.prompt_keys + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
