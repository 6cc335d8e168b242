"""Dense attention over whole sequences, no KV pools, for the published MiMo blocks
(``mimo_blocks``): what the MTP layers' reference forward and the LM's (``mimo_reference``) use.

Attention is causal over the T positions of each row, keys of a sliding layer in ``(t - W, t]``,
per-head sinks as one extra softmax logit with no value (as ``llm_svc.attention``). Leading
batch dimensions are allowed: ``[..., T, H]`` with one ``positions [T]`` for every row.
"""

from __future__ import annotations

import torch

from .base import apply_rope
from .mimo_blocks import Attention, Rotary


def visible(t: int, window: int | None, device: torch.device | str = "cpu") -> torch.Tensor:
    """[T, T] bool: query i sees key j iff j <= i (and j > i - window for a sliding layer)."""
    i = torch.arange(t, device=device)[:, None]
    j = torch.arange(t, device=device)[None, :]
    keep = j <= i
    return keep & (j > i - window) if window is not None else keep


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None,
           sinks: torch.Tensor | None) -> torch.Tensor:
    """q [..., T, Hq, D], k [..., T, Hkv, D], v [..., T, Hkv, Dv] -> [..., T, Hq, Dv]."""
    t, hq = q.shape[-3], q.shape[-2]
    g = hq // k.shape[-2]
    k = k.repeat_interleave(g, dim=-2)  # query head h reads KV head h // g
    v = v.repeat_interleave(g, dim=-2)
    s = torch.einsum("...qhd,...khd->...hqk", q.float(), k.float()) * scale  # [..., Hq, T, T]
    s = s.masked_fill(~visible(t, window, q.device), float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(hq, 1, 1).expand(*s.shape[:-1], 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :t]  # the sink takes mass, adds no value
    else:
        p = torch.softmax(s, dim=-1)
    return torch.einsum("...hqk,...khd->...qhd", p, v.float()).to(q.dtype)


def self_attention(a: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   window: int | None) -> torch.Tensor:
    """One attention block of the module tree: x [..., T, H] (normed) -> o_proj output [..., T, H]."""
    lead = x.shape[:-1]
    q = apply_rope(a.q_proj(x).view(*lead, -1, a.head_dim), cos, sin)  # [..., T, Hq, Dqk]
    k = apply_rope(a.k_proj(x).view(*lead, -1, a.head_dim), cos, sin)  # [..., T, Hkv, Dqk]
    v = a.v_proj(x).view(*lead, -1, a.v_head_dim) * a.v_scale  # [..., T, Hkv, Dv]
    o = attend(q, k, v, a.scaling, window, a.sinks)
    return a.o_proj(o.reshape(*lead, -1))


def rope(rotary: Rotary, x: torch.Tensor, positions: torch.Tensor, layer_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, R] of ``positions [T]`` for one layer type."""
    cos, sin = rotary(x, positions[None], layer_type)
    return cos[0], sin[0]
