"""Pieces shared by the plain-torch attention backends: masks, context slots, masked attention.

Masks follow transformers exactly: causal ``k <= q``; sliding adds ``k > q - W``; a Gemma 3
image span is bidirectional inside itself: ``(causal | same_span) & window``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llm_svc.types.request import SeqForward

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


def ctx_range(sf: SeqForward, kind: str) -> tuple[int, int]:
    """Positions ``[k0, end)`` of the keys ``sf``'s queries may read in ``kind``'s pool."""
    return (0 if kind == FULL else sf.swa_ctx_start), sf.end


def table_slots(table: torch.Tensor, rows: torch.Tensor, k0: torch.Tensor | None, lens: torch.Tensor,
                length: int) -> torch.Tensor:
    """Pool slots ``[B, length]`` of positions ``k0[b] .. k0[b] + lens[b] - 1`` of table row
    ``rows[b]`` (``table [R, capacity]``; ``k0`` None: all 0), 0 past ``lens[b]`` (padding,
    masked by the caller). O(B * length) tensor work, no Python per position."""
    ar = torch.arange(length, device=table.device)
    ok = ar[None, :] < lens[:, None]  # [B, L]
    if k0 is None:  # every context starts at 0 (full layers): row slices
        out = table[:, :length].index_select(0, rows)
    else:
        pos = (k0[:, None] + ar[None, :]).clamp_(max=table.shape[1] - 1)
        out = table[rows[:, None], pos]
    return out.masked_fill_(~ok, 0)


def attend(q, k, v, bias, params: AttentionParams) -> torch.Tensor:
    """q [B, nq, Hq, D], k [Hkv, B, L, D], v [Hkv, B, L, Dv] (head-major, as ``LayerKV.gather``
    returns them), bias [B, nq, L] (0 / -inf) -> [B, nq, Hq, Dv]. Every query row needs one
    finite bias entry (or a sink). Two ``bmm`` over ``Hkv * B`` read the gathered KV in place."""
    b, nq, hq, d = q.shape
    hkv, _, L, dv = v.shape
    g = hq // hkv  # query head h reads kv head h // g (transformers' repeat_kv order)
    qh = q.reshape(b, nq, hkv, g, d).permute(2, 0, 3, 1, 4).reshape(hkv * b, g * nq, d)  # [Hkv*B, G*nq, D]
    s = torch.bmm(qh.to(k.dtype), k.reshape(hkv * b, L, d).transpose(1, 2))  # [Hkv*B, G*nq, L]
    s = s.float().view(hkv, b, g, nq, L).mul_(params.scale)
    if params.softcap is not None:
        s = torch.tanh(s / params.softcap) * params.softcap
    s = s + bias[None, :, None]  # [Hkv, B, G, nq, L]
    if params.sinks is not None:
        sink = params.sinks.float().reshape(hkv, 1, g, 1, 1).expand(hkv, b, g, nq, 1)
        s = torch.cat([s, sink], dim=-1)
    p = torch.softmax(s, dim=-1)
    if params.sinks is not None:
        p = p[..., :-1]  # the sink absorbs probability mass but has no value
    p = p.reshape(hkv * b, g * nq, L).to(v.dtype)
    out = torch.bmm(p, v.reshape(hkv * b, L, dv))  # [Hkv*B, G*nq, Dv]
    return out.view(hkv, b, g, nq, dv).permute(1, 3, 0, 2, 4).reshape(b, nq, hq, dv)



def flash_mask(bias: torch.Tensor, g: int, dtype: torch.dtype) -> torch.Tensor:
    """A bucket's bias ``[B, nq, L]`` in the layout ``attend_flash`` reads: ``[B, 1, G * nq, L]``
    (the ``G`` query heads of a KV head stacked along the query axis)."""
    b, nq, L = bias.shape
    return bias[:, None, None].expand(b, 1, g, nq, L).reshape(b, 1, g * nq, L).to(dtype)


def attend_flash(q, k, v, mask, params: AttentionParams) -> torch.Tensor:
    """``attend`` through the CPU flash-attention kernel (``_scaled_dot_product_flash_attention_for_cpu``:
    blocked, online softmax, no ``[.., nq, L]`` probability tensor in memory). q [B, nq, Hq, D],
    k [Hkv, B, L, D], v [Hkv, B, L, Dv], mask [B, 1, G * nq, L] (``flash_mask``) -> [B, nq, Hq, Dv].
    GQA: the ``G`` query heads of a KV head are stacked along the query axis, so K/V are read as
    gathered. Sinks: the kernel's log-sum-exp gives them exactly, ``out * sigmoid(lse - sink)``
    (an extra logit ``s`` with no value scales every probability by ``sum / (sum + e^s)``).
    Soft-capping is not expressible: callers use ``attend`` for it. The kernel wants one head
    size: MiMo's ``Dqk != Dv`` is zero-padded (V's extra columns give output columns that are
    dropped; zero q/k columns add nothing to a dot product)."""
    b, nq, hq, d = q.shape
    hkv, _, L, dv = v.shape
    g = hq // hkv
    qs = q.reshape(b, nq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * nq, d)  # [B, Hkv, G*nq, D]
    o, lse = _flash(qs.to(k.dtype), k.transpose(0, 1), v.transpose(0, 1), False, params.scale, mask)  # [B, Hkv, G*nq, Dv]
    if params.sinks is not None:
        sink = params.sinks.float().view(1, hkv, g, 1).expand(b, hkv, g, nq).reshape(b, hkv, g * nq)
        o = o * torch.sigmoid(lse - sink).unsqueeze(-1).to(o.dtype)
    return o.view(b, hkv, g, nq, dv).permute(0, 3, 1, 2, 4).reshape(b, nq, hq, dv)


def _flash(q, k, v, causal: bool, scale: float, mask: torch.Tensor | None = None):
    """The CPU flash kernel, which wants one head size (``Dqk != Dv`` zero-padded: V's extra
    columns give output columns that are dropped, zero q / k columns add nothing to a dot
    product): q [B, H, n, D], k/v [B, H, L, D / Dv], mask broadcastable to [B, H, n, L] or None
    -> (o [B, H, n, Dv], lse [B, H, n] float32)."""
    d, dv = k.shape[-1], v.shape[-1]
    if dv < d:
        v = F.pad(v, (0, d - dv))
    elif dv > d:
        q, k = F.pad(q, (0, dv - d)), F.pad(k, (0, dv - d))
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                        scale=scale)
    return o[..., :dv], lse


def attend_tail(q, k, v, n: int, params: AttentionParams) -> torch.Tensor:
    """Full attention of a chunk's ``n`` queries whose keys end with the chunk itself: q [n, Hq, D],
    k [Hkv, L, D], v [Hkv, L, Dv] (the last ``n`` keys are the queries' own positions) -> [n, Hq, Dv].

    No mask at all: the ``L - n`` context keys are visible to every query (the ``G`` query heads
    of a KV head stacked along the query axis, K/V read as given), the chunk's own keys are causal
    (one call per query head, ``is_causal``: the kernel skips the blocks above the diagonal);
    the two halves are merged by their log-sum-exp. Measured (2-core AVX2 box, 2 threads, 8 / 2
    heads of 96, 1,904 queries over 6,000 keys): 456-502 ms with the explicit mask the bucket
    path builds, 308-323 ms this way. Sinks as in ``attend_flash``; no soft-cap."""
    hq, d = q.shape[1], q.shape[2]
    hkv, L, dv = v.shape
    g = hq // hkv
    p = L - n
    qh = q.transpose(0, 1).to(k.dtype).contiguous().unsqueeze(0)  # [1, Hq, n, D]
    kc = k[:, p:].repeat_interleave(g, 0).unsqueeze(0)  # [1, Hq, n, D]: query head h reads kv head h // g
    vc = v[:, p:].repeat_interleave(g, 0).unsqueeze(0)
    o, lse = _flash(qh, kc, vc, True, params.scale)  # [1, Hq, n, Dv], [1, Hq, n]
    o, lse = o[0], lse[0]
    if p > 0:
        qs = qh.view(1, hkv, g * n, d)  # [1, Hkv, G*n, D]
        o1, l1 = _flash(qs, k[None, :, :p], v[None, :, :p], False, params.scale)
        o1, l1 = o1.reshape(hq, n, dv), l1.reshape(hq, n)
        m = torch.maximum(lse, l1)
        a, a1 = (lse - m).exp_(), (l1 - m).exp_()
        s = a + a1
        o = (o * (a / s).unsqueeze(-1).to(o.dtype)).add_(o1 * (a1 / s).unsqueeze(-1).to(o.dtype))
        lse = m + s.log_()
    if params.sinks is not None:
        o = o * torch.sigmoid(lse - params.sinks.float()[:, None]).unsqueeze(-1).to(o.dtype)
    return o.transpose(0, 1)  # [n, Hq, Dv]
