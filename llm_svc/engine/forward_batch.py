"""The contract between the scheduler (pure bookkeeping) and the model runner (tensors).

The scheduler decides *what* runs and *where* its KV lives; the runner only executes that.
Everything here is plain Python (ints and lists): the runner turns it into index tensors.

Attention semantics (same as transformers): a query at absolute position p attends
* in a full-attention layer: keys at positions 0..p,
* in a sliding layer with window W: keys at positions max(0, p-W+1)..p  (W keys incl. itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SeqForward:
    """One sequence's share of a step: a prefill chunk or one decode token.

    Lengths: ``n = len(token_ids) = len(positions) = len(out_full_slots) = len(out_swa_slots)``;
    ``positions`` are consecutive, ``start = positions[0]``, ``end = start + n``.
    ``ctx_full_slots`` are the full-pool slots of positions 0..end-1 (the new ones last);
    ``ctx_swa_slots`` are the SWA-pool slots of positions ``swa_ctx_start..end-1`` with
    ``swa_ctx_start = max(0, start - W + 1)``; every one of them holds valid SWA KV once the new
    tokens are written. The runner writes the new tokens' K/V at ``out_*_slots`` first.
    """

    req_id: str
    token_ids: list[int]
    positions: list[int]
    out_full_slots: list[int]
    out_swa_slots: list[int]
    ctx_full_slots: list[int]
    ctx_swa_slots: list[int]
    swa_ctx_start: int
    need_logits: bool  # True for the last prefill chunk and for decode steps
    # media rows injected at chunk-relative offsets: (offset_in_chunk, row_in_item, item_index)
    mm_rows: list[tuple[int, int, int]] = field(default_factory=list)
    mm_items: list[Any] = field(default_factory=list)  # torch tensors [num_tokens, hidden], owned by the request
    # Gemma 3: tokens of one image attend to each other bidirectionally; spans in absolute positions
    bidirectional_spans: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        assert n >= 1
        assert len(self.positions) == len(self.out_full_slots) == len(self.out_swa_slots) == n
        end = self.positions[0] + n
        assert len(self.ctx_full_slots) == end, (len(self.ctx_full_slots), end)
        assert self.swa_ctx_start + len(self.ctx_swa_slots) == end


@dataclass
class ForwardBatch:
    """All sequences of one engine step, prefill chunks and decodes mixed."""

    seqs: list[SeqForward]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)
