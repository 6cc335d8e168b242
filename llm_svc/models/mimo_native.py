"""MiMo-V2 as torch modules built from a ``MiMoGeometry`` (any dialect), with the weight names
of Xiaomi's published checkpoints (the names transformers also writes, and vLLM's
``mimo_v2_flash.py`` ``load_weights`` reads):

    model.embed_tokens.weight, model.norm.weight, lm_head.weight
    model.layers.N.{input_layernorm,post_attention_layernorm}.weight
    model.layers.N.self_attn.{q,k,v,o}_proj.weight (+ .bias with attention_bias)
    model.layers.N.self_attn.qkv_proj.weight               (``fused_qkv`` layout: split at load)
    *.weight_scale_inv                                      (block FP8: dequantized at load)
    model.layers.N.self_attn.attention_sink_bias           (layers whose kind has sinks)
    model.layers.N.mlp.{gate,up,down}_proj.weight          (dense layers)
    model.layers.N.mlp.gate.weight, mlp.gate.e_score_correction_bias,
    model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight (MoE layers)
    model.mtp.layers.M.*                                    (MTP layers: ``mimo_mtp.py``)

Attribute names follow transformers' ``MiMoV2Flash*`` modules, so the engine's ``MiMoModel``
drives either one. Per-kind heads / head dims / rope theta / sinks come from the geometry, so a
file whose sliding layers have other KV heads or head dims than transformers derives builds
exactly what it says.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_gemv
from .geometry import MiMoGeometry
from .mimo_blocks import MLP, Attention, RMSNorm, Rotary  # noqa: F401 (RMSNorm: the tree's norms, imported from here too)
from .quant import scheme_for
from .weights import fp8_packs_here, load_strict, tensor_files, widen_mixed_groups

log = logging.getLogger(__name__)


class Router(nn.Module):
    """Sigmoid scores; ``e_score_correction_bias`` only steers the choice (noaux_tc); group-limited
    top-k; weights are the chosen raw scores, renormalized, times the routed scaling factor."""

    def __init__(self, g: MiMoGeometry):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(g.n_experts, g.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(g.n_experts))
        self.g = g

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.g
        if g.n_group == 1 and g.top_k <= g.n_experts and cpu_gemv.supports_route(x, self.weight):
            # one C call instead of ~10 small ops (~8% of a decode step, ~7% of a 320-token prefill)
            return cpu_gemv.route(x, self.weight.detach(), self.e_score_correction_bias.detach(), g.top_k,
                                  g.norm_topk_prob, g.routed_scaling_factor)
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        if g.n_group > 1:
            groups = choice.view(-1, g.n_group, g.n_experts // g.n_group).topk(2, dim=-1)[0].sum(-1)  # [T, G]
            keep = torch.zeros_like(groups).scatter_(1, groups.topk(g.topk_group, dim=-1)[1], 1.0)
            mask = keep.unsqueeze(-1).expand(-1, g.n_group, g.n_experts // g.n_group).reshape(-1, g.n_experts)
            choice = choice.masked_fill(mask == 0, float("-inf"))
        idx = choice.topk(g.top_k, dim=-1)[1]  # [T, K]
        w = scores.gather(1, idx)
        if g.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * g.routed_scaling_factor


class MoE(nn.Module):
    def __init__(self, g: MiMoGeometry):
        super().__init__()
        self.gate = Router(g)
        self.first = g.local_experts[0]
        first, stop = g.local_experts  # a rank's own under expert parallelism; its index 0 is expert ``first``
        self.experts = nn.ModuleList(MLP(g.hidden_size, g.moe_intermediate_size) for _ in range(stop - first))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        idx, w = self.gate(x)
        out = torch.zeros_like(x)
        for e in idx.unique().tolist():
            if not 0 <= e - self.first < len(self.experts):
                continue  # another rank's expert
            tok, slot = (idx == e).nonzero(as_tuple=True)
            out.index_add_(0, tok, (self.experts[e - self.first](x[tok]) * w[tok, slot, None]).to(x.dtype))
        return out.view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, g: MiMoGeometry, layer: int):
        super().__init__()
        self.self_attn = Attention(g, g.attn(layer))
        self.mlp = MoE(g) if g.moe_layers[layer] else MLP(g.hidden_size, g.intermediate_size)
        self.input_layernorm = RMSNorm(g.hidden_size, g.rms_eps)
        self.post_attention_layernorm = RMSNorm(g.hidden_size, g.rms_eps)


class Inner(nn.Module):
    def __init__(self, g: MiMoGeometry):
        super().__init__()
        self.embed_tokens = nn.Embedding(g.vocab_size, g.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(g, i) for i in range(g.num_layers))
        self.norm = RMSNorm(g.hidden_size, g.rms_eps)
        self.rotary_emb = Rotary(g)
        if g.mtp_layers:
            from .mimo_mtp import MTPStack  # builds on this module's blocks

            self.mtp = MTPStack(g)


class MiMoForCausalLM(nn.Module):
    """The LM; ``config`` carries what the service reads of an HF config (sizes, eos)."""

    def __init__(self, g: MiMoGeometry, config):
        super().__init__()
        self.geometry = g
        self.config = config
        self.model = Inner(g)
        self.lm_head = nn.Linear(g.hidden_size, g.vocab_size, bias=False)
        self.generation_config = None

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    @property
    def mtp(self) -> list[nn.Module]:
        """The checkpoint's MTP layers (``mimo_mtp.MTPLayer``, in chain order; empty if none).
        They share ``model.embed_tokens`` and ``lm_head``; the LM's forward never runs them."""
        stack = getattr(self.model, "mtp", None)
        return list(stack.layers) if stack is not None else []


# MiMo-V2.5 omni (``MiMoV2OmniForCausalLM``) keeps its towers in the same files; vLLM's
# ``mimo_v2_omni.py`` ``hf_to_vllm_mapper`` names them: ``model.visual.`` / ``visual.`` (ViT),
# ``speech_embeddings.`` + ``audio_encoder.`` (audio; loaded by name, no mapper entry) +
# ``audio_tokenizer.`` (audio), ``model.language_model.`` (the LM, in
# checkpoints saved by transformers >= 4.52). The LM reads past the towers (the encoder's part).
_TOWER_PREFIXES = ("model.visual.", "visual.", "speech_embeddings.", "audio_encoder.", "audio_tokenizer.")


def _published_name(name: str) -> str | None:
    if name.startswith(_TOWER_PREFIXES):
        return None  # media towers
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


_QKV = re.compile(r"model\.(mtp\.)?layers\.(\d+)\.self_attn\.qkv_proj\.(weight|bias)")
_SPLIT = re.compile(r"model\.(mtp\.)?layers\.\d+\.self_attn\.[qkv]_proj\.(weight|bias)")


def split_fused_qkv(t: torch.Tensor, heads: int, kv_heads: int, qk_dim: int, v_dim: int,
                    chunks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused ``qkv_proj`` weight ``[chunks * (Qc + Kc + Vc), in]`` (or bias) -> q, k, v in head
    order. Chunk c holds Q heads ``c*heads/chunks ..``, then its K heads, then its V heads
    (Xiaomi's TP-pre-sharded layout; vLLM ``mimo_v2.py`` ``_shard_fp8_qkv_proj``)."""
    qc, kc, vc = heads // chunks * qk_dim, kv_heads // chunks * qk_dim, kv_heads // chunks * v_dim
    if heads % chunks or kv_heads % chunks or t.shape[0] != chunks * (qc + kc + vc):
        raise ValueError(f"fused qkv_proj has {t.shape[0]} rows, not {chunks} chunks of {qc} Q + {kc} K + {vc} V rows")
    c = t.reshape(chunks, qc + kc + vc, *t.shape[1:])
    return (c[:, :qc].reshape(-1, *t.shape[1:]), c[:, qc:qc + kc].reshape(-1, *t.shape[1:]),
            c[:, qc + kc:].reshape(-1, *t.shape[1:]))


def _convert(g: MiMoGeometry):
    """Module tensors of one stored tensor: a fused ``qkv_proj`` becomes ``q/k/v_proj``."""

    def convert(target: str, t: torch.Tensor, quantized: bool) -> list[tuple[str, torch.Tensor]]:
        m = _QKV.fullmatch(target)
        if m is None:
            if g.layout == "fused_qkv" and _SPLIT.fullmatch(target):
                raise ValueError("is split but attention_projection_layout is 'fused_qkv'")
            return [(target, t)]
        if g.layout != "fused_qkv":
            raise ValueError("is fused but attention_projection_layout is 'split'")
        mtp, layer, kind = m.group(1), int(m.group(2)), m.group(3)
        a = g.sliding if mtp else g.attn(layer) if layer < g.num_layers else g.full  # MTP: the sliding kind
        parts = split_fused_qkv(t, a.heads, a.kv_heads, a.qk_dim, a.v_dim, g.qkv_chunks)
        stem = target[: -len("qkv_proj." + kind)]
        return [(f"{stem}{p}_proj.{kind}", x) for p, x in zip("qkv", parts, strict=True)]

    return convert


def load_mimo(model_dir: str | Path, g: MiMoGeometry, config, dtype: torch.dtype,
              device: str | torch.device = "cpu", tie_word_embeddings: bool = False,
              quantization_config: dict | None = None, config_path: str | Path = "config.json",
              keep_packed: bool = True, shard=None) -> MiMoForCausalLM:
    """Build the LM of ``g`` and its MTP layers and load their weights from ``model_dir`` strictly
    (fused ``qkv_proj`` split per the layout). FP8 linears stay packed in their stored width
    (``weights.load_strict(keep_packed=True)``: ``module.qweight``, no float ``weight``) where
    ``keep_packed`` and ``weights.fp8_packs_here`` (a CPU model, the kernel built); otherwise
    they are dequantized to the serving dtype.

    ``shard`` (``mimo_tp.MiMoShard``): build and read only that tensor-parallel rank's part (its
    heads, columns, experts; no MTP layers), tensor by tensor."""
    full_g = g
    if shard is not None:
        g = shard.geometry
    scheme = scheme_for(quantization_config, config_path, allowed=("fp8",))
    packed = keep_packed and fp8_packs_here(scheme, device)
    def build() -> MiMoForCausalLM:
        m = MiMoForCausalLM(g, config)
        if shard is not None and shard.keeps_mtp:  # rank 0's whole MTP layers beside its share of the LM
            from .mimo_mtp import MTPStack

            m.model.mtp = MTPStack(full_g)
        return m

    if packed:  # no float copy of the weights the file replaces; the rope tables are computed
        with torch.device("meta"):
            m = build()
        m.model.rotary_emb = Rotary(g)
        if getattr(m.model, "mtp", None) is not None:
            for layer in m.model.mtp.layers:
                layer.rotary = Rotary(full_g)
    else:
        m = build()
    derived = frozenset()
    if tie_word_embeddings:
        m.lm_head.weight = m.model.embed_tokens.weight
        derived = frozenset({"lm_head.weight"})
    from .mimo_mtp import check_mtp_layers  # imports this module

    check_mtp_layers({n: f for name, f in tensor_files(model_dir).items() if (n := _published_name(name))}, full_g)
    chunks = g.qkv_chunks if g.layout == "fused_qkv" else 1
    rename = _published_name
    if shard is not None:
        def rename(name: str) -> str | None:
            n = _published_name(name)
            return None if n is None else shard.rename(n)
    load_strict(m, model_dir, dtype, rename, derived, scheme=scheme, convert=_convert(full_g),
                row_groups=lambda n: chunks if n.endswith("qkv_proj.weight") else 1, keep_packed=packed, shard=shard)
    if shard is not None and packed:
        widened = widen_mixed_groups(m)
        if widened:
            log.info("rank %d: %d FP8 linears widened (their block's other linears split off the scale blocks)",
                     shard.rank, widened)
    if tie_word_embeddings:
        m.lm_head.weight = m.model.embed_tokens.weight  # the loaded tensor (a meta one was tied)
    left = [n for n, t in (*m.named_parameters(), *m.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"tensors not loaded: {left[:5]}")
    if scheme is not None:
        kept = [x.qweight for x in m.modules() if getattr(x, "qweight", None) is not None]
        if kept:
            log.info("FP8 linears kept packed: %d tensors, %.2f GiB", len(kept), sum(q.nbytes for q in kept) / 2**30)
        else:
            log.info("FP8 linears dequantized to %s at load (%s)", dtype, "keep_packed off" if not keep_packed else
                     "not on the CPU, or the packed kernel's FP8 build unavailable, or blocks not 128 deep")
    return m.to(device).eval().requires_grad_(False)
