"""MiMo-V2-Flash: hybrid SWA (sliding layers have 2x KV heads and attention sinks), qk head dim
!= v head dim, partial rotary with per-layer-type theta, value scaling, dense + MoE MLPs."""

from __future__ import annotations

import torch

from llm_svc.attention import AttentionBackend, AttentionParams, LayerKV

from . import register_model
from .base import HF_KIND, HybridModel, LayerSpec, apply_rope


@register_model("mimo")
class MiMoModel(HybridModel):
    def __init__(self, hf_model):
        self.hf = hf_model
        self.cfg = hf_model.config
        self.inner = hf_model.model
        self.layer_types = list(self.cfg.layer_types)
        self.window = int(self.cfg.sliding_window)
        self.hidden_size = int(self.cfg.hidden_size)
        self.layers = []
        self.params = []
        for layer, t in zip(self.inner.layers, self.layer_types):
            a = layer.self_attn
            self.layers.append(LayerSpec(HF_KIND[t], a.k_proj.out_features // a.head_dim, a.head_dim, a.v_head_dim))
            self.params.append(AttentionParams(scale=a.scaling, sinks=a.sinks))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner.embed_tokens(ids)

    def forward(self, h, positions, kv: list[LayerKV], attn: AttentionBackend, meta) -> torch.Tensor:
        t = h.shape[0]
        rope = self.rope_tables(self.inner.rotary_emb, h, positions, self.layer_types)
        for i, layer in enumerate(self.inner.layers):
            a = layer.self_attn
            spec = self.layers[i]
            x = layer.input_layernorm(h)
            q = a.q_proj(x).view(t, -1, a.head_dim)  # [T, Hq, Dqk]
            k = a.k_proj(x).view(t, -1, a.head_dim)  # [T, Hkv, Dqk]
            v = a.v_proj(x).view(t, -1, a.v_head_dim) * a.v_scale  # [T, Hkv, Dv]
            cos, sin = rope[self.layer_types[i]]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            o = attn.forward(spec.kind, q, k, v, kv[i], meta, self.params[i])  # [T, Hq, Dv]
            h = h + a.o_proj(o.reshape(t, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.inner.norm(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.hf.lm_head(h).float()
