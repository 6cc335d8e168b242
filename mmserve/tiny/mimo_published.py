"""Tiny MiMo-V2 checkpoints in Xiaomi's published layout (``--arch mimo-v2-flash`` / ``mimo-v2.5``).

Layout, as on the hub (XiaomiMiMo/MiMo-V2-Flash, XiaomiMiMo/MiMo-V2.5): ``config.json`` in
Xiaomi's dialect (key set as read by vLLM's ``mimo_v2_flash.py`` and dropped/renamed by
transformers' ``convert_mimo_v2_flash_weights_to_hf.py``; values as in Megatron-Bridge's
``mimo_v2_flash_bridge.megatron_to_hf_config``: ``sliding_window`` = ``sliding_window_size`` =
``attention_chunk_size``, sinks on sliding layers only, ``topk_method: noaux_tc``,
``routed_scaling_factor: null``), ``model.safetensors`` with per-expert weights and
``self_attn.attention_sink_bias`` (vLLM's ``load_weights`` names), ``num_nextn_predict_layers``
MTP layers under ``model.mtp.layers.M`` (3 as on the hub: ``enorm``, ``hnorm``, ``eh_proj``, a
sliding-attention block with ``pre_mlp_layernorm`` and a dense MLP, ``final_layernorm``; the
names vLLM's ``mimo_v2_mtp.py`` and SGLang's ``mimo_v2_flash_nextn.py`` load),
``generation_config.json`` and a ChatML tokenizer (``tokenizer.json``, ``tokenizer_config.json``
with the chat template). The hub's V2.5 weights use ``attention_projection_layout: fused_qkv``
and block FP8; ``layout="fused_qkv"`` / ``quant="fp8"`` write those forms of the same random
weights (``fuse_qkv`` / ``quantize_fp8``), the default is ``split`` float32.

``to_transformers_dialect`` rewrites such a directory the way transformers' converter does,
for the transformers oracle (only for geometries transformers can express).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class TinyMiMoSpec:
    """The geometry of a tiny published-format MiMo (small sizes, real structure)."""

    architecture: str = "MiMoV2FlashForCausalLM"
    pattern: tuple[int, ...] = (0, 1, 1, 1, 1, 0, 1, 1)  # V2-Flash: full at 0 and every 6th
    moe: tuple[int, ...] = (0, 1, 1, 1, 1, 1, 1, 1)  # first layer dense
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 1
    swa_heads: int = 4
    swa_kv_heads: int = 2  # V2-Flash: twice the full layers' (4 vs 8 on the hub)
    head_dim: int = 32
    v_head_dim: int = 16  # V2-Flash: 192 / 128
    partial_rotary: float = 0.5
    rope_theta: float = 5_000_000.0
    swa_rope_theta: float = 10_000.0
    window: int = 128
    intermediate: int = 256
    moe_intermediate: int = 64
    experts: int = 8
    top_k: int = 2
    value_scale: float = 0.707
    full_sinks: bool = False
    swa_sinks: bool = True
    mtp_layers: int = 3  # num_nextn_predict_layers (3 on MiMo-V2-Flash and MiMo-V2.5)
    eps: float = 1e-5
    extra: dict = field(default_factory=dict)  # more config keys (tests: an unknown field)

    def __post_init__(self) -> None:
        if len(self.pattern) != len(self.moe):
            raise ValueError("pattern and moe must have one entry per layer")

    @property
    def transformers_expressible(self) -> bool:
        """transformers' MiMoV2Flash derives sliding KV heads = 2 x full, shared dims, no full sinks."""
        return (self.swa_kv_heads == 2 * self.kv_heads and self.swa_heads == self.heads and not self.full_sinks
                and self.swa_sinks)


FLASH = TinyMiMoSpec()
# FLASH with qk head dim = v head dim: vLLM 0.32's CPU build has attention only for equal dims
# (its diff-kv backends are Triton-only), so this is the geometry both engines serve there
FLASH_QKV = TinyMiMoSpec(v_head_dim=TinyMiMoSpec.head_dim)
# MiMo-V2.5(-Pro): sliding layers keep the full layers' KV heads (8 and 8 on the hub), 1 full : 6 sliding
V25 = TinyMiMoSpec(architecture="MiMoV2ForCausalLM", pattern=(0, 1, 1, 1, 1, 1, 1, 0), moe=(0,) + (1,) * 7,
                   kv_heads=2, swa_kv_heads=2, rope_theta=10_000_000.0)


def published_config(s: TinyMiMoSpec, vocab_size: int, eos_id: int, pad_id: int) -> dict:
    n = len(s.pattern)
    flash = s.architecture == "MiMoV2FlashForCausalLM"
    stem = "mimo_v2_flash" if flash else "mimo_v2"
    cfg = {
        "architectures": [s.architecture],
        "model_type": stem,
        "auto_map": {
            "AutoConfig": f"configuration_{stem}.{'MiMoV2FlashConfig' if flash else 'MiMoV2Config'}",
            "AutoModelForCausalLM": f"modeling_{stem}.{s.architecture}",
        },
        "vocab_size": vocab_size, "hidden_size": s.hidden, "intermediate_size": s.intermediate,
        "moe_intermediate_size": s.moe_intermediate, "num_hidden_layers": n,
        "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim,
        "v_head_dim": s.v_head_dim, "swa_num_attention_heads": s.swa_heads,
        "swa_num_key_value_heads": s.swa_kv_heads, "swa_head_dim": s.head_dim, "swa_v_head_dim": s.v_head_dim,
        "partial_rotary_factor": s.partial_rotary, "rope_theta": s.rope_theta, "swa_rope_theta": s.swa_rope_theta,
        "rope_scaling": None, "sliding_window": s.window, "sliding_window_size": s.window,
        "attention_chunk_size": s.window, "hybrid_layer_pattern": list(s.pattern), "hybrid_block_size": None,
        "moe_layer_freq": list(s.moe), "n_routed_experts": s.experts, "num_experts_per_tok": s.top_k,
        "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": None,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_shared_experts": None,
        "add_full_attention_sink_bias": s.full_sinks, "add_swa_attention_sink_bias": s.swa_sinks,
        "attention_value_scale": s.value_scale, "layernorm_epsilon": s.eps,
        "num_nextn_predict_layers": s.mtp_layers, "attention_projection_layout": "split",
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
        "max_position_embeddings": 8192, "tie_word_embeddings": False, "use_cache": True,
        "torch_dtype": "float32", "transformers_version": "4.57.1",
        "bos_token_id": None, "eos_token_id": eos_id, "pad_token_id": pad_id,
    }
    cfg.update(s.extra)
    return cfg


def _attention(out: dict, p: str, s: TinyMiMoSpec, sliding: bool) -> None:
    heads, kv = (s.swa_heads, s.swa_kv_heads) if sliding else (s.heads, s.kv_heads)
    out[p + "self_attn.q_proj.weight"] = (heads * s.head_dim, s.hidden)
    out[p + "self_attn.k_proj.weight"] = (kv * s.head_dim, s.hidden)
    out[p + "self_attn.v_proj.weight"] = (kv * s.v_head_dim, s.hidden)
    out[p + "self_attn.o_proj.weight"] = (s.hidden, heads * s.v_head_dim)
    if (s.swa_sinks if sliding else s.full_sinks):
        out[p + "self_attn.attention_sink_bias"] = (heads,)


def mtp_shapes(s: TinyMiMoSpec) -> dict[str, tuple[int, ...]]:
    """The MTP layers' tensors (vLLM ``mimo_v2_mtp.py`` ``MiMoV2MTPLayer``): enorm / hnorm /
    eh_proj, one block of the sliding attention kind with a dense MLP, final_layernorm."""
    h, out = s.hidden, {}
    for m in range(s.mtp_layers):
        p = f"model.mtp.layers.{m}."
        out[p + "enorm.weight"] = (h,)
        out[p + "hnorm.weight"] = (h,)
        out[p + "eh_proj.weight"] = (h, 2 * h)
        out[p + "input_layernorm.weight"] = (h,)
        _attention(out, p, s, sliding=True)
        out[p + "pre_mlp_layernorm.weight"] = (h,)
        out[p + "mlp.gate_proj.weight"] = (s.intermediate, h)
        out[p + "mlp.up_proj.weight"] = (s.intermediate, h)
        out[p + "mlp.down_proj.weight"] = (h, s.intermediate)
        out[p + "final_layernorm.weight"] = (h,)
    return out


def published_shapes(s: TinyMiMoSpec, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Every LM tensor of the published layout (names as in vLLM's ``mimo_v2.py``
    ``load_weights``, then the MTP layers'), in module order, with its shape: derived from the
    spec alone, so the writers need none of mmserve's model code (``shared`` never imports ``llm_svc``)."""
    h = s.hidden
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, h)}
    for i, (kind, moe) in enumerate(zip(s.pattern, s.moe)):
        p = f"model.layers.{i}."
        _attention(out, p, s, sliding=bool(kind))
        if moe:
            out[p + "mlp.gate.weight"] = (s.experts, h)
            out[p + "mlp.gate.e_score_correction_bias"] = (s.experts,)
            for e in range(s.experts):
                q = f"{p}mlp.experts.{e}."
                out[q + "gate_proj.weight"] = (s.moe_intermediate, h)
                out[q + "up_proj.weight"] = (s.moe_intermediate, h)
                out[q + "down_proj.weight"] = (h, s.moe_intermediate)
        else:
            out[p + "mlp.gate_proj.weight"] = (s.intermediate, h)
            out[p + "mlp.up_proj.weight"] = (s.intermediate, h)
            out[p + "mlp.down_proj.weight"] = (h, s.intermediate)
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
    out["model.norm.weight"] = (h,)
    out["lm_head.weight"] = (vocab_size, h)
    return {**out, **mtp_shapes(s)}  # drawn last: the LM's random weights do not depend on them


def random_tensors(shapes: dict[str, tuple[int, ...]], seed: int) -> dict:
    """Random tensors by name, drawn so that greedy outputs vary (a 0.02 normal init makes a
    tiny random model repeat one token): norms near 1, sinks/biases O(1), projections with
    unit-variance outputs."""
    import torch

    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight") or name.endswith("ln_q.weight") or name.endswith(("norm1.weight", "norm2.weight")):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif "attention_sink_bias" in name or name.endswith(".sinks"):
            t = torch.randn(shape, generator=g)
        elif "e_score_correction_bias" in name:
            t = 0.1 * torch.randn(shape, generator=g)
        elif name.endswith(".bias"):
            t = 0.1 * torch.randn(shape, generator=g)
        elif "embed_tokens" in name:
            t = torch.randn(shape, generator=g)
        else:  # [out, in, ...] projections: unit-variance outputs
            fan_in = 1
            for d in shape[1:]:
                fan_in *= d
            t = torch.randn(shape, generator=g) * fan_in ** -0.5
        state[name] = t.contiguous()
    return state


LAYOUTS = ("split", "fused_qkv")
QUANTS = (None, "fp8")
# FP8 linears of MiMo-V2.5 (the hub's model.safetensors.index.json, as a public converter lists
# them): mlp / experts gate|up|down and self_attn.qkv_proj; o_proj, router, norms, embeddings stay bf16;
# the MTP layers' likewise (their o_proj and eh_proj stay bf16: vLLM ``mimo_v2.py`` leaves a
# ``mtp.layers`` o_proj unquantized)
_FP8_LINEAR = re.compile(r"model\.(mtp\.)?layers\.\d+\.(mlp(\.experts\.\d+)?\.(gate|up|down)_proj"
                         r"|self_attn\.(qkv|q|k|v)_proj)\.weight")


_LM_ATTN = re.compile(r"model\.(mtp\.)?layers\.\d+\.self_attn\.")


def fuse_qkv(state: dict, s: TinyMiMoSpec) -> dict:
    """``q/k/v_proj`` -> one ``qkv_proj`` per layer, in ``num_key_value_heads`` chunks
    [Q_c | K_c | V_c] (Xiaomi's TP-pre-sharded rows; vLLM ``mimo_v2.py`` ``_shard_fp8_qkv_proj``:
    chunk count = the full layers' KV heads, also for sliding and MTP layers, whose FP8
    ``qkv_proj`` vLLM's ``mimo_v2_mtp.py`` shards the same way)."""
    import torch

    out, chunks = {}, s.kv_heads
    for name, t in state.items():
        if _LM_ATTN.match(name) and (".self_attn.k_proj." in name or ".self_attn.v_proj." in name):
            continue
        if not (_LM_ATTN.match(name) and ".self_attn.q_proj." in name):  # media towers keep their own layout
            out[name] = t
            continue
        q, k, v = (state[name.replace(".q_proj.", f".{p}_proj.")] for p in "qkv")
        parts = [torch.cat(c) for c in zip(q.chunk(chunks), k.chunk(chunks), v.chunk(chunks), strict=True)]
        out[name.replace(".q_proj.", ".qkv_proj.")] = torch.cat(parts).contiguous()
    return out


def quantize_fp8(state: dict, s: TinyMiMoSpec, block: tuple[int, int] = (128, 128)) -> dict:
    """The FP8 linears (``_FP8_LINEAR``) as e4m3 ``weight`` + float32 ``weight_scale_inv``."""
    from mmserve.tiny.quantize import quantize_fp8_block

    out = {}
    for name, t in state.items():
        if _FP8_LINEAR.fullmatch(name):
            groups = s.kv_heads if ".qkv_proj." in name else 1
            out[name], out[name + "_scale_inv"] = quantize_fp8_block(t, block, groups)
        else:
            out[name] = t
    return out


def write_mimo_published(out: Path, spec: TinyMiMoSpec = FLASH, seed: int = 0, sliding_window: int | None = None,
                         layout: str = "split", quant: str | None = None) -> Path:
    """Write a tiny MiMo-V2 checkpoint in Xiaomi's published layout to ``out`` (``layout`` /
    ``quant``: the same random weights with fused QKV rows / block-FP8 linears)."""
    if layout not in LAYOUTS or quant not in QUANTS:
        raise ValueError(f"layout must be one of {LAYOUTS} and quant one of {QUANTS}, got {layout!r} / {quant!r}")
    import torch
    from safetensors.torch import save_file

    from mmserve.tiny.tokenizer import CHATML_SPECIALS, CHATML_TEMPLATE, build_tokenizer

    if sliding_window is not None and sliding_window != spec.window:
        spec = TinyMiMoSpec(**{**asdict(spec), "window": sliding_window})
    tok = build_tokenizer(CHATML_SPECIALS, 640, CHATML_TEMPLATE, eos="<|im_end|>", pad_token="<|endoftext|>")
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    vocab = -(-len(tok) // 64) * 64  # the hub pads vocab_size past the tokenizer (152576)
    cfg = published_config(spec, vocab, eos, pad)
    state = random_tensors(published_shapes(spec, vocab), seed)
    cfg["attention_projection_layout"] = layout
    if layout == "fused_qkv":
        state = fuse_qkv(state, spec)
    if quant == "fp8":
        from mmserve.tiny.quantize import FP8_QUANT_CONFIG

        state = quantize_fp8(state, spec)
        cfg["quantization_config"] = dict(FP8_QUANT_CONFIG)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [eos], "pad_token_id": pad, "do_sample": False, "transformers_version": "4.57.1"}, indent=2))
    tok.save_pretrained(out)
    if spec.architecture != "MiMoV2FlashForCausalLM":
        # transformers has no "mimo_v2" model type: the hub repo ships its configuration code
        # (auto_map); a config class is all a reader of config.json needs (vLLM: trust_remote_code)
        (out / "configuration_mimo_v2.py").write_text(_V2_CONFIG_CODE)
    return out


_V2_CONFIG_CODE = '''"""MiMo-V2 configuration (tiny stand-in for the hub repo's configuration_mimo_v2.py)."""

from transformers import PretrainedConfig


class MiMoV2Config(PretrainedConfig):
    model_type = "mimo_v2"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
'''


def to_transformers_dialect(src: Path, dst: Path) -> Path:
    """``src`` (published layout) rewritten as transformers' converter does (same weights):
    ``hybrid_layer_pattern`` -> ``layer_types``, ``moe_layer_freq`` -> ``mlp_layer_types``,
    ``layernorm_epsilon`` -> ``rms_norm_eps``, thetas -> per-type ``rope_parameters``; the
    ``swa_*`` / sink keys are dropped (transformers derives them)."""
    cfg = json.loads((src / "config.json").read_text())
    if not (cfg["swa_num_key_value_heads"] == 2 * cfg["num_key_value_heads"] and cfg["add_swa_attention_sink_bias"]
            and not cfg.get("add_full_attention_sink_bias") and cfg.get("swa_head_dim", cfg["head_dim"]) == cfg["head_dim"]):
        raise ValueError("transformers' MiMoV2Flash cannot express this geometry")
    drop = {"attention_chunk_size", "sliding_window_size", "n_shared_experts", "scoring_func", "topk_method",
            "swa_num_attention_heads", "swa_num_key_value_heads", "swa_qk_head_dim", "swa_head_dim", "swa_v_head_dim",
            "add_swa_attention_sink_bias", "add_full_attention_sink_bias", "auto_map", "num_nextn_predict_layers",
            "attention_projection_layout", "hybrid_block_size", "rope_scaling", "torch_dtype"}
    new = {k: v for k, v in cfg.items() if k not in drop}
    new["rms_norm_eps"] = new.pop("layernorm_epsilon")
    new["layer_types"] = ["sliding_attention" if p else "full_attention" for p in new.pop("hybrid_layer_pattern")]
    new["mlp_layer_types"] = ["sparse" if f else "dense" for f in new.pop("moe_layer_freq")]
    new["routed_scaling_factor"] = new.get("routed_scaling_factor") or 1.0
    factor = new.pop("partial_rotary_factor")
    new["rope_parameters"] = {
        "full_attention": {"rope_type": "default", "rope_theta": new.pop("rope_theta"), "partial_rotary_factor": factor},
        "sliding_attention": {"rope_type": "default", "rope_theta": new.pop("swa_rope_theta"),
                              "partial_rotary_factor": factor},
    }
    new["architectures"] = ["MiMoV2FlashForCausalLM"]
    new["model_type"] = "mimo_v2_flash"
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json":
            shutil.copy(f, dst / f.name)
    (dst / "config.json").write_text(json.dumps(new, indent=2))
    return dst
