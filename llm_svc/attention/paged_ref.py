"""Plain-torch reference of paged attention over ``RowRanges``: what the Triton kernel computes.

Each query row attends to key positions ``lo..hi`` of its sequence, read through its slot-table
row from the pool (padded to ``max_len`` and masked). Clear rather than fast: it gathers the
whole ``[T, max_len]`` context, so it is for tests and for running ``triton_paged`` on a machine
without a GPU.
"""

from __future__ import annotations

import torch

from .paged_rows import RowRanges


def paged_attention_ref(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, ranges: RowRanges,
                        scale: float, sinks: torch.Tensor | None = None,
                        softcap: float | None = None) -> torch.Tensor:
    """q [T, Hq, Dqk]; k_pool [Hkv, S, Dqk], v_pool [Hkv, S, Dv]; -> [T, Hq, Dv] in q's dtype.
    Query head ``h`` reads kv head ``h // (Hq // Hkv)``. Softmax in float32 over the visible
    keys plus, with ``sinks [Hq]``, one extra logit ``sinks[h]`` that has no value; ``softcap``:
    scores become ``softcap * tanh(scores / softcap)`` (after the scale)."""
    t, hq, d = q.shape
    hkv, _, dv = v_pool.shape
    g = hq // hkv
    if t == 0:
        return q.new_zeros(0, hq, dv)
    length = max(1, ranges.max_len)
    ar = torch.arange(length, device=q.device)
    lo, hi = ranges.lo.long(), ranges.hi.long()
    pos = lo[:, None] + ar[None, :]  # [T, L]
    ok = pos <= hi[:, None]
    pos = torch.minimum(pos, hi[:, None])  # pads read the row's last key (masked below)
    slots = ranges.table[ranges.trow.long()[:, None], pos]  # [T, L]
    kc = k_pool[:, slots].float()  # [Hkv, T, L, D]
    vc = v_pool[:, slots].float()  # [Hkv, T, L, Dv]
    qg = q.float().view(t, hkv, g, d)
    s = torch.einsum("thgd,htld->thgl", qg, kc) * scale  # [T, Hkv, G, L]
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~ok[:, None, None, :], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, hkv, g, 1).expand(t, hkv, g, 1)
        s = torch.cat([s, sink], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :length]  # the sink column takes mass, adds no value
    out = torch.einsum("thgl,htlv->thgv", p, vc)  # [T, Hkv, G, Dv]
    return out.reshape(t, hq, dv).to(q.dtype)
