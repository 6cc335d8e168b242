"""gpt-oss (``GptOssForCausalLM``): sliding / full layers alternating, per-head attention sinks
on every layer, q/k/v/o biases, YaRN rope, MoE with a clamped SwiGLU (transformers' own modules
for the router, norms and rotary tables; our attention over the pools). The experts are
transformers' ``GptOssExperts``, or, for MXFP4 checkpoints on the CPU, ``gpt_oss_moe``'s packed
ones (the loader swaps them in: ``loading.loader._load_dequantized_hf``)."""

from __future__ import annotations

import torch

from llm_svc.attention import AttentionBackend, AttentionParams, LayerKV

from . import MODELS
from .base import HF_KIND, HybridModel, LayerSpec, apply_rope
from .linear import linears_in, pack_linears


class _Rope:
    """transformers' GptOss rotary returns cos/sin of half the head dim (its rotation pairs
    ``x[:D/2]`` with ``x[D/2:]``); doubled, they are the ``rotate_half`` form ``apply_rope`` reads."""

    def __init__(self, rotary):
        self.rotary = rotary

    def __call__(self, x, position_ids, layer_type):
        cos, sin = self.rotary(x, position_ids)
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


@MODELS.register("gpt_oss")
class GptOssModel(HybridModel):
    def __init__(self, hf_model, linear: str = "auto"):
        self.hf = hf_model
        self.inner = hf_model.model
        cfg = self.inner.config
        self.layer_types = list(cfg.layer_types)
        self.window = int(cfg.sliding_window)
        self.hidden_size = int(cfg.hidden_size)
        self.rope = _Rope(self.inner.rotary_emb)
        self.layers, self.params = [], []
        for layer, t in zip(self.inner.layers, self.layer_types, strict=True):
            a = layer.self_attn
            self.layers.append(LayerSpec(HF_KIND[t], a.k_proj.out_features // a.head_dim, a.head_dim, a.head_dim))
            self.params.append(AttentionParams(scale=a.scaling, sinks=a.sinks))
        pack_linears(linears_in(self.inner.layers) + [hf_model.lm_head], linear)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner.embed_tokens(ids)

    def forward(self, h, positions, kv: list[LayerKV], attn: AttentionBackend, meta) -> torch.Tensor:
        t = h.shape[0]
        cos, sin = self.rope_tables(self.rope, h, positions, ["all"])["all"]  # one rope for every layer
        for i, layer in enumerate(self.inner.layers):
            a, spec = layer.self_attn, self.layers[i]
            x = layer.input_layernorm(h)
            q = apply_rope(a.q_proj(x).view(t, -1, spec.qk_dim), cos, sin)  # [T, Hq, D]
            k = apply_rope(a.k_proj(x).view(t, -1, spec.qk_dim), cos, sin)  # [T, Hkv, D]
            v = a.v_proj(x).view(t, -1, spec.v_dim)
            o = attn.forward(spec.kind, q, k, v, kv[i], meta, self.params[i])  # [T, Hq, D]
            h = h + a.o_proj(o.reshape(t, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h)[None])[0][0]  # (out [1, T, H], router scores)
        return self.inner.norm(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.hf.lm_head(h).float()
