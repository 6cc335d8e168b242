"""Per-request slot tables that live across steps: the runner's copy of each request's KV view.

The scheduler sends only changes (``SeqForward``: new out slots, or a reset); ``apply`` folds
one batch's changes in. Two implementations of one protocol:

* ``DeviceSlotTables`` (the runner): two ``[rows, capacity]`` long tensors on the device, one
  row per live request, indexed by absolute position (vLLM's persistent block table, with
  block size 1). Per step: one ``index_put`` of the new slots; rows and capacity grow by
  doubling; a reset writes one row slice.
* ``HostSlotTables`` (the scheduler simulator and tests): the same in Python lists.

In the SWA table only positions inside the window (``swa_ctx_start..end-1`` of the last batch)
are meaningful; older entries are stale and never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llm_svc.types.request import ForwardBatch, SeqForward

NO_SLOT = -1


class TableProtocolError(RuntimeError):
    """A step's changes do not continue the runner's table (the scheduler forgot a reset)."""


def _check_continues(sf: SeqForward, length: int | None) -> None:
    if sf.reset_full is None and (length or 0) != sf.start:
        raise TableProtocolError(
            f"{sf.req_id}: step starts at {sf.start} but the runner's table covers {length or 0} positions"
        )


@dataclass
class StepTables:
    """What attention reads in one step: ``full``/``swa`` ``[rows, capacity]`` long (slot of
    each position per row), ``rows[i]`` the table row of ``batch.seqs[i]``."""

    full: torch.Tensor
    swa: torch.Tensor
    rows: list[int]


class DeviceSlotTables:
    """Slot tables as tensors on ``device`` (see module doc)."""

    def __init__(self, device: torch.device | str = "cpu", rows: int = 16, capacity: int = 1024):
        self.device = torch.device(device)
        self.full = torch.zeros(rows, capacity, dtype=torch.long, device=self.device)
        self.swa = torch.zeros(rows, capacity, dtype=torch.long, device=self.device)
        self.row_of: dict[str, int] = {}
        self.length: dict[int, int] = {}  # row -> positions covered
        self._free = list(range(rows - 1, -1, -1))

    @property
    def capacity(self) -> int:
        return self.full.shape[1]

    def reserve(self, rows: int, capacity: int) -> None:
        """Grow to at least ``rows`` x ``capacity`` now, so that steps within it never
        reallocate the tables (what a captured CUDA graph reads must stay where it was)."""
        self._grow(rows, capacity)

    def _grow(self, rows: int, capacity: int) -> None:
        old_r, old_c = self.full.shape
        if rows <= old_r and capacity <= old_c:
            return
        nr, nc = max(rows, old_r), max(capacity, old_c)
        for name in ("full", "swa"):
            t = torch.zeros(nr, nc, dtype=torch.long, device=self.device)
            t[:old_r, :old_c] = getattr(self, name)
            setattr(self, name, t)
        self._free = list(range(nr - 1, old_r - 1, -1)) + self._free

    def _row(self, req_id: str) -> int:
        row = self.row_of.get(req_id)
        if row is None:
            if not self._free:
                self._grow(2 * self.full.shape[0], 0)
            row = self._free.pop()
            self.row_of[req_id] = row
            self.length[row] = 0
        return row

    def drop(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            del self.length[row]
            self._free.append(row)

    def apply(self, batch: ForwardBatch) -> StepTables:
        """Drop ``batch.dropped``, cut ``batch.truncated``, apply resets, append every seq's out slots."""
        for rid in batch.dropped:
            self.drop(rid)
        for rid, n in batch.truncated.items():
            row = self.row_of.get(rid)
            if row is not None:
                self.length[row] = min(self.length[row], n)
        need = max(sf.end for sf in batch.seqs)
        if need > self.capacity:
            self._grow(0, max(need, 2 * self.capacity))
        rows: list[int] = []
        r_idx: list[int] = []
        p_idx: list[int] = []
        f_val: list[int] = []
        s_val: list[int] = []
        for sf in batch.seqs:
            row = self._row(sf.req_id)
            _check_continues(sf, self.length[row])
            if sf.reset_full is not None:
                self._reset(row, sf)
            n = len(sf.token_ids)
            r_idx.extend([row] * n)
            p_idx.extend(range(sf.start, sf.end))
            f_val.extend(sf.out_full_slots)
            s_val.extend(sf.out_swa_slots)
            self.length[row] = sf.end
            rows.append(row)
        upd = torch.tensor([r_idx, p_idx, f_val, s_val], dtype=torch.long).to(self.device)  # [4, T]
        self.full.index_put_((upd[0], upd[1]), upd[2])
        self.swa.index_put_((upd[0], upd[1]), upd[3])
        return StepTables(self.full, self.swa, rows)

    def _reset(self, row: int, sf: SeqForward) -> None:
        if sf.start:
            self.full[row, :sf.start] = torch.tensor(sf.reset_full, dtype=torch.long).to(self.device)
        if sf.reset_swa:
            self.swa[row, sf.swa_ctx_start:sf.start] = torch.tensor(sf.reset_swa, dtype=torch.long).to(self.device)


class HostSlotTables:
    """The same protocol in Python lists (for the scheduler simulator and tests)."""

    def __init__(self) -> None:
        self.full: dict[str, list[int]] = {}
        self.swa: dict[str, list[int]] = {}

    def apply(self, batch: ForwardBatch) -> None:
        for rid in batch.dropped:
            self.full.pop(rid, None)
            self.swa.pop(rid, None)
        for rid, n in batch.truncated.items():
            if rid in self.full:
                del self.full[rid][n:]
                del self.swa[rid][n:]
        for sf in batch.seqs:
            full = self.full.get(sf.req_id)
            _check_continues(sf, None if full is None else len(full))
            if sf.reset_full is not None:
                full = list(sf.reset_full)
                swa = [NO_SLOT] * sf.swa_ctx_start + list(sf.reset_swa)
                self.full[sf.req_id], self.swa[sf.req_id] = full, swa
            elif full is None:
                full, swa = self.full.setdefault(sf.req_id, []), self.swa.setdefault(sf.req_id, [])
            swa = self.swa[sf.req_id]
            full.extend(sf.out_full_slots)
            swa.extend(sf.out_swa_slots)

    def ctx_full(self, sf: SeqForward) -> list[int]:
        """Full-pool slots of positions ``0..end-1`` (after ``apply``)."""
        return self.full[sf.req_id][: sf.end]

    def ctx_swa(self, sf: SeqForward) -> list[int]:
        """SWA-pool slots of positions ``swa_ctx_start..end-1`` (after ``apply``)."""
        return self.swa[sf.req_id][sf.swa_ctx_start: sf.end]
