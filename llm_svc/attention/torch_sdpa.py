"""Reference attention in plain torch: one masked matmul softmax per prefill chunk.

All single-token decodes form one padded batch ``[B, 1, Lmax]``; each prefill chunk is its own
group ``[1, n, L]`` (a Python loop per layer). Kept as the simple, obviously-right backend the
batched one (``torch_batched``) is tested against; select it as ``torch_sdpa_loop``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llm_svc.types.request import ForwardBatch, SeqForward
from llm_svc.attention.slot_tables import StepTables

from . import ATTENTION_BACKENDS
from .base import FULL, SLIDING, AttentionBackend, AttentionParams, LayerKV
from .torch_common import additive_bias, allowed_mask, attend, ctx_range


@dataclass
class Group:
    """Sequences attended together: decodes as one ``[B, 1, L]`` batch, or one prefill chunk."""

    rows: torch.Tensor  # [B * nq] long: rows of the step's token tensor, in group order
    nq: int  # queries per sequence
    ctx_slots: torch.Tensor  # [B, L] long: pool slot of each context position (pad: 0)
    bias: torch.Tensor  # [B, nq, L] float32: 0 where the query may attend, -inf elsewhere


@dataclass
class KindMeta:
    out_slots: torch.Tensor  # [T] long
    groups: list[Group]


@dataclass
class StepMeta:
    kinds: dict[str, KindMeta]


def _ctx(table: torch.Tensor, trow: int, k0: int, end: int) -> torch.Tensor:
    return table[trow, k0:end]  # [L] long: the slots of positions k0..end-1


def _prefill_group(sf: SeqForward, row: int, trow: int, kind: str, table: torch.Tensor, window: int,
                   device) -> Group:
    k0, end = ctx_range(sf, kind)
    n = len(sf.token_ids)
    qpos = torch.arange(sf.start, sf.end)
    kpos = torch.arange(k0, end)
    mask = allowed_mask(qpos, kpos, sf.bidirectional_spans, window if kind == SLIDING else None)
    return Group(torch.arange(row, row + n, device=device), n, _ctx(table, trow, k0, end)[None],
                 additive_bias(mask[None], device))


def _decode_group(members: list[tuple[int, int, SeqForward]], kind: str, table: torch.Tensor, device) -> Group:
    """A decode sees its whole context (full: 0..p; sliding: the scheduler already cut it to
    the window), so its mask is only the padding mask."""
    ranges = [ctx_range(sf, kind) for _, _, sf in members]
    L = max(e - k0 for k0, e in ranges)
    padded = torch.zeros(len(members), L, dtype=torch.long, device=table.device)
    for j, ((_, trow, _), (k0, e)) in enumerate(zip(members, ranges)):
        padded[j, : e - k0] = _ctx(table, trow, k0, e)
    lens = torch.tensor([e - k0 for k0, e in ranges])
    mask = (torch.arange(L)[None, :] < lens[:, None])[:, None, :]  # [B, 1, L]
    rows = torch.tensor([r for r, _, _ in members], dtype=torch.long, device=device)
    return Group(rows, 1, padded, additive_bias(mask, device))


@ATTENTION_BACKENDS.register("torch_sdpa_loop")
class TorchLoopAttention(AttentionBackend):
    name = "torch_sdpa_loop"

    def prepare(self, batch: ForwardBatch, tables: StepTables, window: int, device: torch.device) -> StepMeta:
        kinds: dict[str, KindMeta] = {}
        for kind in (FULL, SLIDING):
            table = tables.full if kind == FULL else tables.swa
            out: list[int] = []
            decodes: list[tuple[int, int, SeqForward]] = []
            groups: list[Group] = []
            row = 0
            for sf, trow in zip(batch.seqs, tables.rows):
                n = len(sf.token_ids)
                out.extend(sf.out_full_slots if kind == FULL else sf.out_swa_slots)
                if n == 1:
                    decodes.append((row, trow, sf))
                else:
                    groups.append(_prefill_group(sf, row, trow, kind, table, window, device))
                row += n
            if decodes:
                groups.append(_decode_group(decodes, kind, table, device))
            kinds[kind] = KindMeta(torch.tensor(out, dtype=torch.long, device=device), groups)
        return StepMeta(kinds)

    def forward(self, kind, q, k, v, cache: LayerKV, meta: StepMeta, params: AttentionParams) -> torch.Tensor:
        km = meta.kinds[kind]
        cache.write(km.out_slots, k, v)
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        for grp in km.groups:
            b = grp.ctx_slots.shape[0]
            qg = q[grp.rows].view(b, grp.nq, q.shape[1], q.shape[2])  # [B, nq, Hq, D]
            kg, vg = cache.gather(grp.ctx_slots, q.dtype)  # [Hkv, B, L, D], [Hkv, B, L, Dv]
            o = attend(qg, kg, vg, grp.bias, params)  # [B, nq, Hq, Dv]
            out.index_copy_(0, grp.rows, o.reshape(b * grp.nq, q.shape[1], -1))
        return out
