"""The building blocks of MiMo-V2's published module tree that the LM's layers and the MTP
layers share (``mimo_native``, ``mimo_mtp``): RMSNorm, one attention kind's projections, the
dense gated MLP and the per-kind rotary tables. Attribute names are the checkpoint's."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .geometry import FULL_T, SLIDING_T, AttnGeometry, MiMoGeometry


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # one op instead of six; the same values to 1e-6 (tests/unit/test_fused_mlp.py)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    """q/k/v/o projections (+ sinks) of one attention kind ``a`` (a layer's, or the MTP layers' sliding one)."""

    def __init__(self, g: MiMoGeometry, a: AttnGeometry):
        super().__init__()
        self.head_dim, self.v_head_dim = a.qk_dim, a.v_dim
        self.scaling = a.qk_dim ** -0.5
        self.v_scale = g.value_scale
        bias = g.attention_bias
        self.q_proj = nn.Linear(g.hidden_size, a.heads * a.qk_dim, bias=bias)
        self.k_proj = nn.Linear(g.hidden_size, a.kv_heads * a.qk_dim, bias=bias)
        self.v_proj = nn.Linear(g.hidden_size, a.kv_heads * a.v_dim, bias=bias)
        self.o_proj = nn.Linear(a.heads * a.v_dim, g.hidden_size, bias=False)
        self.attention_sink_bias = nn.Parameter(torch.zeros(a.heads)) if a.sinks else None

    @property
    def sinks(self) -> torch.Tensor | None:
        return self.attention_sink_bias


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Rotary(nn.Module):
    """cos/sin per layer type (own theta and rotary dim), called like transformers' MiMo rotary:
    ``(x, position_ids [1, N], layer_type) -> cos, sin [1, N, R]`` (R = the rotary dim)."""

    def __init__(self, g: MiMoGeometry):
        super().__init__()
        self.inv_freq = {}
        for t, a in ((FULL_T, g.full), (SLIDING_T, g.sliding)):
            r = a.rotary_dim
            self.inv_freq[t] = 1.0 / (a.rope_theta ** (torch.arange(0, r, 2, dtype=torch.int64).float() / r))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str):
        freqs = position_ids[..., None].float() * self.inv_freq[layer_type].to(x.device)[None, None]  # [1, N, R/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)
