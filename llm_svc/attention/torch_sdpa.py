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
    rows: torch.Tensor  # [B, nq] long: row of each query in the step's token tensor (pad: 0)
    q_valid: torch.Tensor  # [B, nq] bool
    ctx_slots: torch.Tensor  # [B, L] long: pool slot of each context position (pad: 0)
    mask: torch.Tensor  # [B, nq, L] bool: query may attend to context position


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


def _seq_tensors(sf: SeqForward, kind: str, window: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    qpos = torch.tensor(sf.positions, dtype=torch.long)
    if kind == FULL:
        slots = sf.ctx_full_slots
        kpos = torch.arange(len(slots), dtype=torch.long)
        mask = _allowed(qpos, kpos, sf.bidirectional_spans, None)
    else:
        slots = sf.ctx_swa_slots
        kpos = torch.arange(sf.swa_ctx_start, sf.swa_ctx_start + len(slots), dtype=torch.long)
        mask = _allowed(qpos, kpos, sf.bidirectional_spans, window)
    return slots, kpos, mask


def _pad_group(members: list[tuple[list[int], torch.Tensor, list[int]]], device) -> Group:
    """members: (query rows, mask [n, L], ctx slots) -> one padded Group."""
    b = len(members)
    nq = max(len(r) for r, _, _ in members)
    L = max(len(s) for _, _, s in members)
    rows = torch.zeros(b, nq, dtype=torch.long)
    q_valid = torch.zeros(b, nq, dtype=torch.bool)
    ctx = torch.zeros(b, L, dtype=torch.long)
    mask = torch.zeros(b, nq, L, dtype=torch.bool)
    for i, (r, m, s) in enumerate(members):
        rows[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        q_valid[i, : len(r)] = True
        ctx[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : m.shape[0], : m.shape[1]] = m
    return Group(rows.to(device), q_valid.to(device), ctx.to(device), mask.to(device))


def attend(q, k, v, mask, params: AttentionParams) -> torch.Tensor:
    """q [B, nq, Hq, D], k [B, L, Hkv, D], v [B, L, Hkv, Dv], mask [B, nq, L] -> [B, nq, Hq, Dv]."""
    b, nq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv  # query head h reads kv head h // g (transformers' repeat_kv order)
    qh = q.reshape(b, nq, hkv, g, d).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, nq, D]
    kh = k.permute(0, 2, 3, 1).unsqueeze(2)  # [B, Hkv, 1, D, L]
    s = torch.matmul(qh, kh).float() * params.scale  # [B, Hkv, G, nq, L]
    if params.softcap is not None:
        s = torch.tanh(s / params.softcap) * params.softcap
    s = s.masked_fill(~mask[:, None, None], float("-inf"))
    if params.sinks is not None:
        sink = params.sinks.float().reshape(1, hkv, g, 1, 1).expand(b, hkv, g, nq, 1)
        s = torch.cat([s, sink], dim=-1)
    p = torch.softmax(s, dim=-1)
    if params.sinks is not None:
        p = p[..., :-1]  # the sink absorbs probability mass but has no value
    vh = v.permute(0, 2, 1, 3).unsqueeze(2)  # [B, Hkv, 1, L, Dv]
    out = torch.matmul(p.to(v.dtype), vh)  # [B, Hkv, G, nq, Dv]
    return out.permute(0, 3, 1, 2, 4).reshape(b, nq, hq, -1)


@register_attention_backend("torch")
class TorchAttention(AttentionBackend):
    name = "torch"

    def prepare(self, batch: ForwardBatch, window: int, device: torch.device) -> StepMeta:
        kinds: dict[str, KindMeta] = {}
        for kind in (FULL, SLIDING):
            out: list[int] = []
            decodes: list[tuple[list[int], torch.Tensor, list[int]]] = []
            groups: list[Group] = []
            row = 0
            for sf in batch.seqs:
                n = len(sf.token_ids)
                out.extend(sf.out_full_slots if kind == FULL else sf.out_swa_slots)
                slots, _, mask = _seq_tensors(sf, kind, window)
                member = (list(range(row, row + n)), mask, slots)
                if n == 1:
                    decodes.append(member)
                else:
                    groups.append(_pad_group([member], device))
                row += n
            if decodes:
                groups.append(_pad_group(decodes, device))
            kinds[kind] = KindMeta(torch.tensor(out, dtype=torch.long, device=device), groups)
        return StepMeta(kinds)

    def forward(self, kind, q, k, v, cache: LayerKV, meta: StepMeta, params: AttentionParams) -> torch.Tensor:
        km = meta.kinds[kind]
        cache.write(km.out_slots, k, v)
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
        for grp in km.groups:
            qg = q[grp.rows]  # [B, nq, Hq, D]
            kg = cache.k[grp.ctx_slots]  # [B, L, Hkv, D]
            vg = cache.v[grp.ctx_slots]
            o = attend(qg, kg.to(q.dtype), vg.to(q.dtype), grp.mask, params)
            out[grp.rows[grp.q_valid]] = o[grp.q_valid]
        return out
