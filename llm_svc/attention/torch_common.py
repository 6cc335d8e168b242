"""Pieces shared by the plain-torch attention backends: masks, context slots, masked attention.

Masks follow transformers exactly: causal ``k <= q``; sliding adds ``k > q - W``; a Gemma 3
image span is bidirectional inside itself: ``(causal | same_span) & window``.
"""

from __future__ import annotations

import torch

from llm_svc.engine.forward_batch import SeqForward

from .base import FULL, AttentionParams


def allowed_mask(qpos: torch.Tensor, kpos: torch.Tensor, spans: list[tuple[int, int]],
                 window: int | None) -> torch.Tensor:
    """``[..., n, L]`` bool mask of queries at ``qpos [..., n]`` over keys at ``kpos [..., L]``."""
    q, k = qpos[..., :, None], kpos[..., None, :]
    ok = k <= q
    for s, e in spans:
        ok |= (q >= s) & (q < e) & (k >= s) & (k < e)
    if window is not None:
        ok &= k > q - window
    return ok


def additive_bias(mask: torch.Tensor, device) -> torch.Tensor:
    """Bool mask -> additive float bias, built once per step and shared by all layers (an add
    is several times cheaper than ``masked_fill`` with a broadcast mask on CPU)."""
    return torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, float("-inf")).to(device)


def ctx_of(sf: SeqForward, kind: str) -> tuple[list[int], int]:
    """Context slots of ``kind``'s pool and the position of the first one."""
    return (sf.ctx_full_slots, 0) if kind == FULL else (sf.ctx_swa_slots, sf.swa_ctx_start)


def attend(q, k, v, bias, params: AttentionParams) -> torch.Tensor:
    """q [B, nq, Hq, D], k [B, L, Hkv, D], v [B, L, Hkv, Dv], bias [B, nq, L] (0 / -inf)
    -> [B, nq, Hq, Dv]. Every query row needs one finite bias entry (or a sink)."""
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
