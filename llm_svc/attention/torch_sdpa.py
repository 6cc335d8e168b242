"""Reference attention in plain torch: one masked matmul softmax per prefill chunk.

All single-token decodes form one padded batch ``[B, 1, Lmax]``; each prefill chunk is its own
group ``[1, n, L]`` (a Python loop per layer). Kept as the simple, obviously-right backend the
batched one (``torch_batched``) is tested against; select it as ``torch_sdpa_loop``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llm_svc.engine.forward_batch import ForwardBatch, SeqForward

from . import register_attention_backend
from .base import FULL, SLIDING, AttentionBackend, AttentionParams, LayerKV
from .torch_common import additive_bias, allowed_mask, attend, ctx_of


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


def _prefill_group(sf: SeqForward, row: int, kind: str, window: int, device) -> Group:
    slots, k0 = ctx_of(sf, kind)
    n = len(sf.token_ids)
    qpos = torch.arange(sf.positions[0], sf.positions[0] + n)
    kpos = torch.arange(k0, k0 + len(slots))
    mask = allowed_mask(qpos, kpos, sf.bidirectional_spans, window if kind == SLIDING else None)
    return Group(torch.arange(row, row + n, device=device), n,
                 torch.tensor([slots], dtype=torch.long, device=device), additive_bias(mask[None], device))


def _decode_group(members: list[tuple[int, SeqForward]], kind: str, device) -> Group:
    """A decode sees its whole context (full: 0..p; sliding: the scheduler already cut it to
    the window), so its mask is only the padding mask."""
    ctxs = [ctx_of(sf, kind)[0] for _, sf in members]
    L = max(len(c) for c in ctxs)
    padded = [c + [0] * (L - len(c)) for c in ctxs]
    lens = torch.tensor([len(c) for c in ctxs])
    mask = (torch.arange(L)[None, :] < lens[:, None])[:, None, :]  # [B, 1, L]
    rows = torch.tensor([r for r, _ in members], dtype=torch.long, device=device)
    return Group(rows, 1, torch.tensor(padded, dtype=torch.long, device=device), additive_bias(mask, device))


@register_attention_backend("torch_sdpa_loop")
class TorchLoopAttention(AttentionBackend):
    name = "torch_sdpa_loop"

    def prepare(self, batch: ForwardBatch, window: int, device: torch.device) -> StepMeta:
        kinds: dict[str, KindMeta] = {}
        for kind in (FULL, SLIDING):
            out: list[int] = []
            decodes: list[tuple[int, SeqForward]] = []
            groups: list[Group] = []
            row = 0
            for sf in batch.seqs:
                n = len(sf.token_ids)
                out.extend(sf.out_full_slots if kind == FULL else sf.out_swa_slots)
                if n == 1:
                    decodes.append((row, sf))
                else:
                    groups.append(_prefill_group(sf, row, kind, window, device))
                row += n
            if decodes:
                groups.append(_decode_group(decodes, kind, device))
            kinds[kind] = KindMeta(torch.tensor(out, dtype=torch.long, device=device), groups)
        return StepMeta(kinds)

    def forward(self, kind, q, k, v, cache: LayerKV, meta: StepMeta, params: AttentionParams) -> torch.Tensor:
        km = meta.kinds[kind]
        cache.write(km.out_slots, k, v)
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        for grp in km.groups:
            b = grp.ctx_slots.shape[0]
            qg = q[grp.rows].view(b, grp.nq, q.shape[1], q.shape[2])  # [B, nq, Hq, D]
            idx = grp.ctx_slots.view(-1)  # index_select is ~5x faster than advanced indexing on CPU
            kg = cache.k.index_select(0, idx).view(b, -1, *cache.k.shape[1:]).to(q.dtype)  # [B, L, Hkv, D]
            vg = cache.v.index_select(0, idx).view(b, -1, *cache.v.shape[1:]).to(q.dtype)
            o = attend(qg, kg, vg, grp.bias, params)  # [B, nq, Hq, Dv]
            out.index_copy_(0, grp.rows, o.reshape(b * grp.nq, q.shape[1], -1))
        return out
