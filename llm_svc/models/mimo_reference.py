"""A dense forward of the whole published MiMo LM (``mimo_native``) over whole sequences, no KV
pools: the reference the MTP layers are trained and tested with (``mimo_dense`` holds the
attention it uses)."""

from __future__ import annotations

import torch

from .geometry import SLIDING_T
from .mimo_dense import rope, self_attention
from .mimo_native import DecoderLayer, MiMoForCausalLM


def decoder_layer(layer: DecoderLayer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  window: int | None) -> torch.Tensor:
    """Pre-norm block: h + attn(norm(h)), then + mlp(norm(.)); h [..., T, H]."""
    h = h + self_attention(layer.self_attn, layer.input_layernorm(h), cos, sin, window)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def lm_hidden(m: MiMoForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """ids [..., T] at positions 0..T-1 -> final-normed hidden states [..., T, H] (the input of
    ``lm_head``, and of MTP layer 0)."""
    g, inner = m.geometry, m.model
    h = inner.embed_tokens(ids)
    positions = torch.arange(ids.shape[-1], device=ids.device)
    tables = {t: rope(inner.rotary_emb, h, positions, t) for t in set(g.layer_types)}
    for i, layer in enumerate(inner.layers):
        kind = g.layer_types[i]
        h = decoder_layer(layer, h, *tables[kind], g.window if kind == SLIDING_T else None)
    return inner.norm(h)
