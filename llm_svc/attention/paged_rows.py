"""Per-query-row key ranges for paged attention: what a paged kernel reads straight from the pool.

For every query row the keys it may see are ONE contiguous range of positions ``[lo, hi]`` of
its sequence (the masks of ``torch_common.allowed_mask``, as ``torch_batched`` applies them):

* ``hi = q`` (causal), except inside a Gemma 3 bidirectional span ``[s, e)``: the union of
  ``k <= q`` and the span is ``k < e``, so ``hi = min(e, seq.end) - 1`` (the max over spans
  holding ``q``);
* full layers: ``lo = 0``; sliding layers: ``lo = max(swa_ctx_start, q - W + 1)`` (the window
  ``k > q - W``; keys before ``swa_ctx_start`` are never read, their SWA slots are stale).

``lo <= q <= hi`` always, so every row has at least one key. Positions map to pool slots
through the sequence's row of the kind's slot table (``tables.full`` / ``tables.swa``).

Built from O(seqs + spans) Python and tensor ops on the host, then moved to the device in one
copy; no per-token Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llm_svc.types.request import ForwardBatch
from llm_svc.attention.slot_tables import StepTables

from .base import FULL, SLIDING


@dataclass
class RowRanges:
    """One layer kind's step metadata, rows in batch token order (``T`` rows)."""

    out_slots: torch.Tensor  # [T] long: pool slot the row's new K/V is written to
    trow: torch.Tensor  # [T] int32: slot-table row of the row's sequence
    lo: torch.Tensor  # [T] int32: first visible key position
    hi: torch.Tensor  # [T] int32: last visible key position (inclusive)
    table: torch.Tensor  # [R, C] long: the kind's slot table (position -> slot)
    max_len: int  # max(hi - lo + 1)
    # host copies of the per-sequence layout (first batch row, rows), for kernel row blocks
    seq_row0: torch.Tensor = field(repr=False, default=None)  # [S] long, cpu
    seq_n: torch.Tensor = field(repr=False, default=None)  # [S] long, cpu
    _blocks: dict = field(repr=False, default_factory=dict)

    @property
    def num_rows(self) -> int:
        return int(self.lo.shape[0])

    def blocks(self, block_m: int, multi: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Row blocks of one sequence each, on the device: ``(row0 [NB] int32, n [NB] int32)``.
        ``multi=False``: every single-row sequence (decodes) as a block of 1; ``multi=True``:
        the sequences with more than one row cut into blocks of at most ``block_m`` rows.
        Cached per ``(block_m, multi)``: every layer of the step reuses them."""
        key = (block_m if multi else 1, multi)
        got = self._blocks.get(key)
        if got is None:
            sel = self.seq_n > 1 if multi else self.seq_n == 1
            row0, n = self.seq_row0[sel], self.seq_n[sel]
            if multi and len(n):
                nblk = (n + block_m - 1) // block_m
                seq = torch.repeat_interleave(torch.arange(len(n)), nblk)
                first = torch.cumsum(nblk, 0) - nblk
                idx = torch.arange(int(nblk.sum())) - first[seq]
                row0, n = row0[seq] + idx * block_m, torch.clamp(n[seq] - idx * block_m, max=block_m)
            dev = self.lo.device
            got = (row0.to(torch.int32).to(dev), n.to(torch.int32).to(dev))
            self._blocks[key] = got
        return got


def row_ranges(batch: ForwardBatch, tables: StepTables, window: int,
               device: torch.device | str) -> dict[str, RowRanges]:
    """``{FULL: RowRanges, SLIDING: RowRanges}`` of one step (see module doc)."""
    seqs = batch.seqs
    n = torch.tensor([len(s.token_ids) for s in seqs], dtype=torch.long)
    start = torch.tensor([s.start for s in seqs], dtype=torch.long)
    swa0 = torch.tensor([s.swa_ctx_start for s in seqs], dtype=torch.long)
    trows = torch.tensor(list(tables.rows), dtype=torch.long)
    t = int(n.sum())
    row0 = torch.cumsum(n, 0) - n
    seq = torch.repeat_interleave(torch.arange(len(seqs)), n)  # [T] sequence of each row
    pos = start[seq] + (torch.arange(t) - row0[seq])  # [T] absolute position of each row
    hi = pos.clone()
    for i, s in enumerate(seqs):  # O(spans): rows inside a span see up to its end
        end = s.start + len(s.token_ids)
        for a, e in s.bidirectional_spans:
            ra, rb = max(a, s.start) - s.start, min(e, end) - s.start
            if rb > ra:
                r = int(row0[i])
                hi[r + ra:r + rb].clamp_(min=min(e, end) - 1)
    lo_swa = torch.maximum(swa0[seq], pos - window + 1)
    out_full = [x for s in seqs for x in s.out_full_slots]
    out_swa = [x for s in seqs for x in s.out_swa_slots]
    host = torch.stack([torch.tensor(out_full, dtype=torch.long), torch.tensor(out_swa, dtype=torch.long),
                        trows[seq], hi, lo_swa])  # [5, T]: one host -> device copy
    dev = host.to(device)
    trow, hi_d, lo_swa_d = dev[2].to(torch.int32), dev[3].to(torch.int32), dev[4].to(torch.int32)
    max_full = int((hi + 1).max()) if t else 0
    max_swa = int((hi - lo_swa + 1).max()) if t else 0
    return {
        FULL: RowRanges(dev[0], trow, torch.zeros_like(hi_d), hi_d, tables.full, max_full, row0, n),
        SLIDING: RowRanges(dev[1], trow, lo_swa_d, hi_d, tables.swa, max_swa, row0, n),
    }
