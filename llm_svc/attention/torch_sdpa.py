"""CPU/any-device attention in plain torch: gather context KV by slot, masked matmul softmax.

Sequences are grouped so padding stays small: all single-token decodes form one padded batch
``[B, 1, Lmax]``; each prefill chunk is its own group ``[1, n, L]``.
Masks follow transformers exactly: causal ``k <= q``; sliding adds ``k > q - W``; a Gemma 3
image span is bidirectional inside itself: ``(causal | same_span) & window``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llm_svc.engine.forward_batch import ForwardBatch, SeqForward

from . import register_attention_backend
from .base import FULL, SLIDING, AttentionBackend, AttentionParams, LayerKV


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


def _allowed(qpos: torch.Tensor, kpos: torch.Tensor, spans: list[tuple[int, int]], window: int | None) -> torch.Tensor:
    """``[n, L]`` bool mask of a sequence's queries at ``qpos [n]`` over keys at ``kpos [L]``."""
    q, k = qpos[:, None], kpos[None, :]
    ok = k <= q
    for s, e in spans:
        ok |= (q >= s) & (q < e) & (k >= s) & (k < e)
    if window is not None:
        ok &= k > q - window
    return ok


def _bias(mask: torch.Tensor, device) -> torch.Tensor:
    """Bool mask -> additive float bias, built once per step and shared by all layers (an add
    is several times cheaper than ``masked_fill`` with a broadcast mask on CPU)."""
    return torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, float("-inf")).to(device)


def _ctx(sf: SeqForward, kind: str) -> tuple[list[int], int]:
    """Context slots of ``kind``'s pool and the position of the first one."""
    return (sf.ctx_full_slots, 0) if kind == FULL else (sf.ctx_swa_slots, sf.swa_ctx_start)


def _prefill_group(sf: SeqForward, row: int, kind: str, window: int, device) -> Group:
    slots, k0 = _ctx(sf, kind)
    n = len(sf.token_ids)
    qpos = torch.arange(sf.positions[0], sf.positions[0] + n)
    kpos = torch.arange(k0, k0 + len(slots))
    mask = _allowed(qpos, kpos, sf.bidirectional_spans, window if kind == SLIDING else None)
    return Group(torch.arange(row, row + n, device=device), n,
                 torch.tensor([slots], dtype=torch.long, device=device), _bias(mask[None], device))


def _decode_group(members: list[tuple[int, SeqForward]], kind: str, device) -> Group:
    """A decode sees its whole context (full: 0..p; sliding: the scheduler already cut it to
    the window), so its mask is only the padding mask."""
    ctxs = [_ctx(sf, kind)[0] for _, sf in members]
    L = max(len(c) for c in ctxs)
    padded = [c + [0] * (L - len(c)) for c in ctxs]
    lens = torch.tensor([len(c) for c in ctxs])
    mask = (torch.arange(L)[None, :] < lens[:, None])[:, None, :]  # [B, 1, L]
    rows = torch.tensor([r for r, _ in members], dtype=torch.long, device=device)
    return Group(rows, 1, torch.tensor(padded, dtype=torch.long, device=device), _bias(mask, device))


def attend(q, k, v, bias, params: AttentionParams) -> torch.Tensor:
    """q [B, nq, Hq, D], k [B, L, Hkv, D], v [B, L, Hkv, Dv], bias [B, nq, L] (0 / -inf)
    -> [B, nq, Hq, Dv]."""
    b, nq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv  # query head h reads kv head h // g (transformers' repeat_kv order)
    qh = q.reshape(b, nq, hkv, g, d)
    s = torch.einsum("bqhgd,blhd->bhgql", qh, k).float() * params.scale  # [B, Hkv, G, nq, L]
    if params.softcap is not None:
        s = torch.tanh(s / params.softcap) * params.softcap
    s = s + bias[:, None, None]
    if params.sinks is not None:
        sink = params.sinks.float().reshape(1, hkv, g, 1, 1).expand(b, hkv, g, nq, 1)
        s = torch.cat([s, sink], dim=-1)
    p = torch.softmax(s, dim=-1)
    if params.sinks is not None:
        p = p[..., :-1]  # the sink absorbs probability mass but has no value
    out = torch.einsum("bhgql,blhd->bqhgd", p.to(v.dtype), v)  # [B, nq, Hkv, G, Dv]
    return out.reshape(b, nq, hq, -1)


@register_attention_backend("torch")
class TorchAttention(AttentionBackend):
    name = "torch"

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
