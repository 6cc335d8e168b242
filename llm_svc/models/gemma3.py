"""Gemma 3 (text LM, or the LM inside Gemma3ForConditionalGeneration): q/k RMS norms, sandwich
norms around attention and MLP, query_pre_attn_scalar, per-layer-type rope, scaled embeddings."""

from __future__ import annotations

import torch

from llm_svc.attention import AttentionBackend, AttentionParams, LayerKV

from . import MODELS
from .base import HF_KIND, HybridModel, LayerSpec, apply_rope
from .linear import linears_in, pack_linears


@MODELS.register("gemma3")
class Gemma3Model(HybridModel):
    def __init__(self, hf_model, linear: str = "auto"):
        self.hf = hf_model
        # Gemma3ForConditionalGeneration.model.language_model or Gemma3ForCausalLM.model
        self.inner = getattr(hf_model.model, "language_model", hf_model.model)
        self.cfg = self.inner.config
        self.layer_types = list(self.cfg.layer_types)
        self.window = int(self.cfg.sliding_window)
        self.hidden_size = int(self.cfg.hidden_size)
        # only Gemma3ForCausalLM soft-caps its logits (the multimodal class does not)
        self.final_softcap = (
            getattr(self.cfg, "final_logit_softcapping", None)
            if type(hf_model).__name__ == "Gemma3ForCausalLM" else None
        )
        self.layers, self.params = [], []
        for layer, t in zip(self.inner.layers, self.layer_types):
            a = layer.self_attn
            self.layers.append(LayerSpec(HF_KIND[t], self.cfg.num_key_value_heads, a.head_dim, a.head_dim))
            # transformers' Gemma3Attention never passes attn_logit_softcapping to its attention
            # (Gemma 3 checkpoints leave it None): neither do we, so both give the same logits
            self.params.append(AttentionParams(scale=a.scaling))
        pack_linears(linears_in(self.inner.layers) + [hf_model.lm_head], linear)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner.embed_tokens(ids)  # scaled by sqrt(hidden) inside

    def forward(self, h, positions, kv: list[LayerKV], attn: AttentionBackend, meta) -> torch.Tensor:
        t = h.shape[0]
        rope = self.rope_tables(self.inner.rotary_emb, h, positions, self.layer_types)
        for i, layer in enumerate(self.inner.layers):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q = a.q_norm(a.q_proj(x).view(t, -1, a.head_dim))  # [T, Hq, D]
            k = a.k_norm(a.k_proj(x).view(t, -1, a.head_dim))  # [T, Hkv, D]
            v = a.v_proj(x).view(t, -1, a.head_dim)
            cos, sin = rope[self.layer_types[i]]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            o = attn.forward(self.layers[i].kind, q, k, v, kv[i], meta, self.params[i])
            h = h + layer.post_attention_layernorm(a.o_proj(o.reshape(t, -1)))
            h = h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
        return self.inner.norm(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        out = self.hf.lm_head(h).float()
        if self.final_softcap is not None:
            out = torch.tanh(out / self.final_softcap) * self.final_softcap
        return out
