"""Gemma 3 (text LM, or the LM inside Gemma3ForConditionalGeneration): q/k RMS norms, sandwich
norms around attention and MLP, query_pre_attn_scalar, per-layer-type rope, scaled embeddings.

On the CPU in float32 or bfloat16 the layers run fused (``_forward_fused``): q | k | v in one GEMM, gate | up in
one, every RMSNorm and residual add as ``cpu_fused.add_rmsnorm`` passes (Gemma's ``1 + weight``
taken once at load: ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` rounds as transformers' does), q / k
norms over head rows, rope in place (``qkv_post``). Eager, a decode step was ~40 small ops per
layer: the benchmark checkpoint's (12 layers, hidden 512) one-sequence decode step 19.4 ms
in-process against the MiMo checkpoint's 11.7 at the same weight bytes. At bfloat16 the norms
take the float32 ``1 + w`` and round once (``cpu_fused.add_rmsnorm`` with a float32 weight), as
Gemma3RMSNorm does. Elsewhere (CUDA, float16, no C compiler) the eager modules run as before."""

from __future__ import annotations

import torch

from llm_svc.attention import AttentionBackend, AttentionParams, LayerKV

from . import MODELS, cpu_fused
from .base import HF_KIND, HybridModel, LayerSpec, apply_rope
from .fused_mlp import GatedMLP
from .linear import fuse_linears, linears_in, pack_linears


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
        w = hf_model.lm_head.weight
        # float32, or bfloat16 with the norms' float32 (1 + weight) rounded once, as Gemma3RMSNorm
        self.fused = (w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16)
                      and cpu_fused.available(w.dtype))
        if not self.fused:
            pack_linears(linears_in(self.inner.layers) + [hf_model.lm_head], linear)
            return
        self.qkv = [fuse_linears([x.self_attn.q_proj, x.self_attn.k_proj, x.self_attn.v_proj], linear)
                    for x in self.inner.layers]
        self.mlps = [GatedMLP.pack(x.mlp, act=x.mlp.act_fn, backend=linear) for x in self.inner.layers]
        pack_linears([x.self_attn.o_proj for x in self.inner.layers] + [hf_model.lm_head], linear)
        # (1 + weight) of every norm, taken once: Gemma3RMSNorm multiplies by it in float32
        self.w1 = {id(n): (1.0 + n.weight.detach().float()).contiguous()
                   for x in self.inner.layers
                   for n in (x.input_layernorm, x.post_attention_layernorm, x.pre_feedforward_layernorm,
                             x.post_feedforward_layernorm, x.self_attn.q_norm, x.self_attn.k_norm)}
        self.w1[id(self.inner.norm)] = (1.0 + self.inner.norm.weight.detach().float()).contiguous()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner.embed_tokens(ids)  # scaled by sqrt(hidden) inside

    def forward(self, h, positions, kv: list[LayerKV], attn: AttentionBackend, meta) -> torch.Tensor:
        t = h.shape[0]
        rope = self.rope_tables(self.inner.rotary_emb, h, positions, self.layer_types)
        if self.fused and h.dtype == self.hf.lm_head.weight.dtype:
            return self._forward_fused(h.contiguous(), rope, kv, attn, meta)
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

    def _norm(self, norm, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """``norm(x)`` (``add`` given: ``x += add`` in place first) as one C pass over rows."""
        return cpu_fused.add_rmsnorm(x, add, self.w1[id(norm)], norm.eps)

    def _forward_fused(self, h, rope, kv: list[LayerKV], attn: AttentionBackend, meta) -> torch.Tensor:
        """The layers with fused GEMMs and element-wise passes; ``h`` (the residual stream) is
        added to in place."""
        t = h.shape[0]
        y = None  # the last MLP's normed output, not yet added to h
        for i, layer in enumerate(self.inner.layers):
            a, spec = layer.self_attn, self.layers[i]
            x = self._norm(layer.input_layernorm, h, y)
            qkv = self.qkv[i](x)  # [T, (Hq + 2 Hkv) * D]
            d, hk = spec.qk_dim, spec.kv_heads
            hq = qkv.shape[1] // d - 2 * hk
            nq, nk = hq * d, hk * d
            # q / k norms over each head's D values (rows of [T * H, D]), written back for rope
            qkv[:, :nq] = self._norm(a.q_norm, qkv[:, :nq].reshape(t * hq, d)).view(t, nq)
            qkv[:, nq:nq + nk] = self._norm(a.k_norm, qkv[:, nq:nq + nk].reshape(t * hk, d)).view(t, nk)
            cos, sin = rope[self.layer_types[i]]
            q, k, v = qkv[:, :nq].view(t, hq, d), qkv[:, nq:nq + nk].view(t, hk, d), qkv[:, nq + nk:].view(t, hk, d)
            if cpu_fused.supports_qkv(qkv, cos, sin):
                cpu_fused.qkv_post(qkv, hq, hk, d, d, cos, sin)  # rope on q and k, in place
            else:
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            o = attn.forward(spec.kind, q, k, v, kv[i], meta, self.params[i])  # [T, Hq, D]
            y = self._norm(layer.post_attention_layernorm, a.o_proj(o.reshape(t, -1)))
            x = self._norm(layer.pre_feedforward_layernorm, h, y)
            y = self._norm(layer.post_feedforward_layernorm, self.mlps[i](x))
        return self._norm(self.inner.norm, h, y)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        out = self.hf.lm_head(h).float()
        if self.final_softcap is not None:
            out = torch.tanh(out / self.final_softcap) * self.final_softcap
        return out
