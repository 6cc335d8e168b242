"""Prefill / decode pairing (docs/disagg.md): which requests a decode replica has prefilled on a
prefill replica, and which one.

Conditional disaggregation, as NVIDIA Dynamo's router does it: a request is prefilled remotely
only when that can pay. It stays local to its decode replica (a plain request) when

* its prompt is estimated shorter than ``min_prompt_tokens`` (a short prefill costs the decode
  replica less than a hand-over's round trip), counting media rows (embeddings sent by reference
  are fetched by the prefill replica alone, by value they travel in the body),
  A prompt under that length but at least ``idle_min_prompt_tokens`` long goes to a prefill
  replica that is idle (none of this gateway's prefills in flight): capacity that would sit
  unused, taking a prefill off the decode replica's steps.
* the decode replica already holds at least ``max_cached_fraction`` of its prefix blocks (the
  router's view), so only a short tail is left to prefill,
* no prefill replica is routable, or the chosen one already has ``max_prefill_queue`` of this
  gateway's prefills in flight (Dynamo's "prefill queue short" condition: a busy prefill replica
  would make the prompt wait longer than its decode replica takes to prefill it).

Otherwise the prefill replica is chosen cache-aware (longest held prefix, load breaking ties)
and the decode replica calls it (``kv_transfer_params.do_remote_prefill``); if that call fails,
the decode replica prefills the prompt itself. Only bookkeeping here: nothing talks to a
replica.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.routing.llm_router import LLMRouter
from gateway.routing.replicas import ReplicaPool
from shared.rawwire import pack_raw, unpack_raw
from shared.schemas import GenerateRequest, KVTransferParams

DECISIONS = ("remote", "local_short", "local_cached", "local_no_prefill", "local_busy")


@dataclass(frozen=True)
class PairingConfig:
    min_prompt_tokens: int = 256
    max_cached_fraction: float = 0.5
    max_prefill_queue: int = 0  # 0: no bound
    # a prompt under min_prompt_tokens but at least this long goes to an idle prefill replica
    # (none of this gateway's prefills in flight): free prefill capacity; None: never
    idle_min_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.min_prompt_tokens < 0:
            raise ValueError(f"min_prompt_tokens must be >= 0, got {self.min_prompt_tokens}")
        if not 0.0 < self.max_cached_fraction <= 1.0:
            raise ValueError(f"max_cached_fraction must be in (0, 1], got {self.max_cached_fraction}")
        if self.max_prefill_queue < 0:
            raise ValueError(f"max_prefill_queue must be >= 0, got {self.max_prefill_queue}")
        if self.idle_min_prompt_tokens is not None and not 0 <= self.idle_min_prompt_tokens:
            raise ValueError(f"idle_min_prompt_tokens must be >= 0, got {self.idle_min_prompt_tokens}")


class PrefillPairing:
    """``pool``: the prefill replicas; ``router``: their cache-aware router."""

    def __init__(self, pool: ReplicaPool, router: LLMRouter, config: PairingConfig) -> None:
        self.pool = pool
        self.router = router
        self.config = config
        self.decisions: Counter[str] = Counter({d: 0 for d in DECISIONS})

    def choose(self, req: GenerateRequest, est_tokens: int, blocks: Sequence[int], decode_held: int) -> str | None:
        """The prefill replica for ``req`` (None: prefill it on its decode replica), counted by
        decision. ``decode_held``: leading ``blocks`` the chosen decode replica holds."""
        cfg = self.config
        long = est_tokens >= cfg.min_prompt_tokens
        if not long and (cfg.idle_min_prompt_tokens is None or est_tokens < cfg.idle_min_prompt_tokens):
            return self._count("local_short")
        if blocks and decode_held >= cfg.max_cached_fraction * len(blocks):
            return self._count("local_cached")
        replicas = self.pool.routable()
        if not replicas:
            return self._count("local_no_prefill")
        if not long:  # a shorter prompt takes only an idle prefill replica
            replicas = [r for r in replicas if self.router.load(r) == 0]
            if not replicas:
                return self._count("local_busy")
        chosen = self.router.choose(replicas, blocks)
        if self.config.max_prefill_queue and self.router.load(chosen) >= self.config.max_prefill_queue:
            return self._count("local_busy")
        self.decisions["remote"] += 1
        return chosen

    def _count(self, decision: str) -> None:
        self.decisions[decision] += 1
        return None

    @staticmethod
    def body(req: GenerateRequest, body: bytes, prefill_url: str) -> bytes:
        """The decode replica's wire body for ``req`` (its media tensors kept from ``body``, the
        packed request) naming ``prefill_url``."""
        tensors, _ = unpack_raw(body, GenerateRequest)
        return pack_raw(tensors, req.model_copy(update={"kv_transfer_params": KVTransferParams(
            do_remote_prefill=True, remote_prefill_url=prefill_url)}))
