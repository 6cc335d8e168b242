"""MiMo-V2 (Flash / V2.5): hybrid SWA with per-kind KV heads, head dims, rope theta and sinks,
qk head dim != v head dim, partial rotary, value scaling, dense + MoE MLPs.

Drives either module tree: transformers' ``MiMoV2FlashForCausalLM`` (a transformers-dialect
checkpoint) or ``mimo_native.MiMoForCausalLM`` (a published-dialect one). The layer shapes come
from the one ``MiMoGeometry`` of the config and are checked against the loaded modules."""

from __future__ import annotations

from collections.abc import Callable

import torch

from llm_svc.attention import AttentionBackend, AttentionParams, LayerKV
from llm_svc.parallel import SINGLE

from . import MODELS
from .base import HF_KIND, HybridModel, LayerSpec, apply_rope
from . import cpu_fused
from .fused_mlp import GatedMLP, RoutedExperts
from .linear import fuse_linears, pack_linears
from .geometry import MiMoGeometry, mimo_geometry


def geometry_of(hf_model) -> MiMoGeometry:
    """The geometry a loaded module tree was built from (native) or its HF config implies."""
    g = getattr(hf_model, "geometry", None)
    return g if g is not None else mimo_geometry(hf_model.config.to_dict(), "config.json (loaded)")


@MODELS.register("mimo")
class MiMoModel(HybridModel):
    def __init__(self, hf_model, linear: str = "auto"):
        self.hf = hf_model
        self.inner = hf_model.model
        self.geometry = g = geometry_of(hf_model)
        self.layer_types = list(g.layer_types)
        self.window = g.window
        self.hidden_size = g.hidden_size
        self.layers, self.params = [], []
        for i, (layer, t) in enumerate(zip(self.inner.layers, self.layer_types, strict=True)):
            a, kind = layer.self_attn, g.attn(i)
            spec = LayerSpec(HF_KIND[t], kind.kv_heads, kind.qk_dim, kind.v_dim)
            if (a.k_proj.out_features, a.v_proj.out_features) != (spec.kv_heads * spec.qk_dim, spec.kv_heads * spec.v_dim):
                raise ValueError(f"layer {i}: loaded k/v projections disagree with the config's geometry {kind}")
            self.layers.append(spec)
            self.params.append(AttentionParams(scale=a.scaling, sinks=a.sinks))
        # a tensor-parallel rank's part (``mimo_tp``): o_proj's and the MLPs' partial sums are all-reduced
        self.group = getattr(hf_model, "rank_group", None) or SINGLE
        self.mlps = [_mlp_of(layer.mlp, linear) for layer in self.inner.layers]
        # q | k | v in one GEMM per layer ([T, (Hq + Hkv) * Dqk + Hkv * Dv])
        self.qkv = [fuse_linears([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj], linear)
                    for layer in self.inner.layers]
        # only what the forward calls: the MLPs' own linears are replaced by the fused callables
        pack_linears([layer.self_attn.o_proj for layer in self.inner.layers] + [hf_model.lm_head], linear)
        self.heads = [g.attn(i).heads for i in range(len(self.layers))]
        self.norms = [layer.input_layernorm for layer in self.inner.layers] + [self.inner.norm]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner.embed_tokens(ids)

    def forward(self, h, positions, kv: list[LayerKV], attn: AttentionBackend, meta) -> torch.Tensor:
        """As ``HybridModel.forward``; ``h`` is the residual stream, added to in place."""
        t = h.shape[0]
        rope = self.rope_tables(self.inner.rotary_emb, h, positions, self.layer_types)
        y = None  # the last block's output, not yet added to h
        for i, layer in enumerate(self.inner.layers):
            a = layer.self_attn
            spec = self.layers[i]
            h, x = add_norm(h, y, self.norms[i])
            hq, hk = self.heads[i], spec.kv_heads
            qkv = self.qkv[i](x)  # [T, (Hq + Hkv) * Dqk + Hkv * Dv]
            cos, sin = rope[self.layer_types[i]]
            nq, nk = hq * spec.qk_dim, hk * spec.qk_dim
            q = qkv[:, :nq].view(t, hq, spec.qk_dim)  # [T, Hq, Dqk]
            k = qkv[:, nq:nq + nk].view(t, hk, spec.qk_dim)  # [T, Hkv, Dqk]
            v = qkv[:, nq + nk:].view(t, hk, spec.v_dim)  # [T, Hkv, Dv]
            if cpu_fused.supports_qkv(qkv, cos, sin):
                cpu_fused.qkv_post(qkv, hq, hk, spec.qk_dim, spec.v_dim, cos, sin, a.v_scale)  # in place, exact
            else:
                q, k, v = apply_rope(q, cos, sin), apply_rope(k, cos, sin), v * a.v_scale
            o = attn.forward(spec.kind, q, k, v, kv[i], meta, self.params[i])  # [T, Hq, Dv]
            h, x = add_norm(h, self.group.all_reduce(a.o_proj(o.reshape(t, -1))), layer.post_attention_layernorm)
            y = self.group.all_reduce(self.mlps[i](x))
        return add_norm(h, y, self.norms[-1])[1]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.hf.lm_head(h).float()


def add_norm(h: torch.Tensor, y: torch.Tensor | None, norm) -> tuple[torch.Tensor, torch.Tensor]:
    """``h + y`` (y None: h) and its RMSNorm by ``norm`` (a MiMo RMSNorm module: ``weight``,
    ``eps`` or transformers' ``variance_epsilon``): one C pass on the CPU, h updated in place."""
    if cpu_fused.supports_norm(h, norm.weight) and (y is None or y.stride(-1) == 1):
        eps = getattr(norm, "eps", None)
        return h, cpu_fused.add_rmsnorm(h, y, norm.weight, norm.variance_epsilon if eps is None else eps)
    if y is not None:
        h = h + y
    return h, norm(h)


def _mlp_of(mlp, linear: str = "auto") -> Callable[[torch.Tensor], torch.Tensor]:
    """One layer's MLP as a fused callable ``[T, H] -> [T, H]``: a gated MLP with gate and up in
    one GEMM, or the router + ``RoutedExperts`` (transformers' router returns ``(logits, w,
    idx)``, the published tree's ``(idx, w)``; both choose and weigh experts the same way)."""
    if not hasattr(mlp, "experts"):
        return GatedMLP.pack(mlp, backend=linear)
    experts = RoutedExperts.pack(mlp.experts, backend=linear)
    gate = mlp.gate
    hf_router = hasattr(mlp.experts, "gate_up_proj")
    first = getattr(mlp, "first", 0)
    local = first > 0 or experts.num_experts < mlp.gate.weight.shape[0]  # expert parallel: some experts elsewhere

    def moe(x: torch.Tensor) -> torch.Tensor:
        if hf_router:
            _, w, idx = gate(x)
        else:
            idx, w = gate(x)
        if local:
            return _local_experts(experts, first, x, idx, w)
        return experts(x, idx, w)

    return moe


def _local_experts(experts: RoutedExperts, first: int, x: torch.Tensor, idx: torch.Tensor,
                   w: torch.Tensor) -> torch.Tensor:
    """This rank's share of a MoE layer under expert parallelism: only the (token, expert) pairs
    routed to its experts ``[first, first + E_local)``, each as a one-expert row (x [T, H], idx /
    w [T, K] over all experts -> [T, H], the other ranks' pairs left to them and summed by the
    all-reduce that follows)."""
    mine = (idx >= first) & (idx < first + experts.num_experts)  # [T, K]
    tok, slot = mine.nonzero(as_tuple=True)  # [P] each
    out = torch.zeros_like(x)
    if tok.numel():
        rows = experts(x.index_select(0, tok), (idx[tok, slot] - first)[:, None], w[tok, slot][:, None])  # [P, H]
        out.index_add_(0, tok, rows.to(x.dtype))
    return out
