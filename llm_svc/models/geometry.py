"""One description of a MiMo-V2 decoder, read from either config dialect.

* **transformers** (``MiMoV2FlashConfig`` as transformers 5.x writes it): ``layer_types``,
  ``mlp_layer_types``, ``rope_parameters`` per layer type, ``rms_norm_eps``. Sliding layers get
  twice the KV heads of full layers and attention sinks; both kinds share head dims and heads
  (transformers' ``MiMoV2FlashAttention``).
* **published** (Xiaomi's ``config.json`` of XiaomiMiMo/MiMo-V2-Flash and MiMo-V2.5, read by
  vLLM's ``mimo_v2_flash.py`` / ``mimo_v2.py``): ``hybrid_layer_pattern`` (0 = full, 1 =
  sliding), ``moe_layer_freq``, ``swa_num_attention_heads``, ``swa_num_key_value_heads``,
  ``swa_head_dim``, ``swa_v_head_dim``, ``swa_rope_theta``, ``sliding_window_size``,
  ``add_{full,swa}_attention_sink_bias``, ``attention_value_scale``, ``layernorm_epsilon``,
  ``num_nextn_predict_layers``, ``attention_projection_layout`` (``split`` or ``fused_qkv``),
  ``quantization_config`` (block FP8, dequantized at load: ``quant.py``). Key list checked against
  transformers' ``convert_mimo_v2_flash_weights_to_hf.py`` (the keys it drops or renames) and
  Megatron-Bridge's ``mimo_v2_flash_bridge.py`` (the keys it writes back).

Every key of the file must be known: one this module cannot map is a ``CheckpointError`` that
names the file and the key, never a silently different model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shared.bundle import CheckpointError

from .quant import scheme_for

FULL_T, SLIDING_T = "full_attention", "sliding_attention"

# keys that change nothing about the forward pass (bookkeeping, training, hub plumbing)
_INERT = {
    "architectures", "model_type", "auto_map", "torch_dtype", "dtype", "transformers_version", "use_cache",
    "initializer_range", "attention_dropout", "max_position_embeddings", "bos_token_id", "eos_token_id",
    "pad_token_id", "output_attentions", "output_hidden_states", "return_dict", "tie_word_embeddings",
    "_name_or_path", "keys_to_ignore_at_inference", "max_window_layers", "use_sliding_window", "context_len",
    "chunk_size_feed_forward", "id2label", "label2id", "is_encoder_decoder", "problem_type",  # PretrainedConfig.to_dict
}
# MiMo-V2.5 omni: read by the encoder service from the same file, not by the LM
_MEDIA = {"vision_config", "audio_config", "processor_config"}
_PUBLISHED = {
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "v_head_dim", "swa_num_attention_heads",
    "swa_num_key_value_heads", "swa_head_dim", "swa_qk_head_dim", "swa_v_head_dim", "rope_theta",
    "swa_rope_theta", "partial_rotary_factor", "rope_scaling", "sliding_window", "sliding_window_size",
    "attention_chunk_size", "hybrid_layer_pattern", "hybrid_block_size", "moe_layer_freq", "n_routed_experts",
    "num_experts_per_tok", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor", "scoring_func",
    "topk_method", "n_shared_experts", "add_full_attention_sink_bias", "add_swa_attention_sink_bias",
    "attention_value_scale", "layernorm_epsilon", "num_nextn_predict_layers", "attention_projection_layout",
    "hidden_act", "attention_bias", "moe_router_dtype", "quantization_config",
}
_TRANSFORMERS = {
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "v_head_dim", "rope_parameters", "sliding_window",
    "layer_types", "mlp_layer_types", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
    "norm_topk_prob", "routed_scaling_factor", "attention_value_scale", "rms_norm_eps", "hidden_act",
    "attention_bias", "quantization_config",
}


@dataclass(frozen=True)
class AttnGeometry:
    """Attention of one layer kind: heads, head dims, rope, sinks."""

    heads: int
    kv_heads: int
    qk_dim: int
    v_dim: int
    rope_theta: float
    rotary_dim: int
    sinks: bool

    def __post_init__(self) -> None:
        if min(self.heads, self.kv_heads, self.qk_dim, self.v_dim) < 1 or self.heads % self.kv_heads:
            raise ValueError(f"bad attention geometry {self}")
        if not 0 < self.rotary_dim <= self.qk_dim or self.rotary_dim % 2:
            raise ValueError(f"rotary dim {self.rotary_dim} must be even and in (0, {self.qk_dim}]")


@dataclass(frozen=True)
class MiMoGeometry:
    """A MiMo-V2 decoder, whichever dialect its config was written in."""

    dialect: str  # "transformers" | "published" (where it was read from; the model is the same)
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # FULL_T / SLIDING_T per layer
    moe_layers: tuple[bool, ...]
    full: AttnGeometry
    sliding: AttnGeometry
    window: int
    intermediate_size: int
    moe_intermediate_size: int
    n_experts: int
    top_k: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    value_scale: float
    rms_eps: float
    attention_bias: bool = False
    mtp_layers: int = 0  # num_nextn_predict_layers (mimo_mtp.py; transformers' dialect drops them)
    # ``fused_qkv``: one ``qkv_proj`` per layer, rows in ``qkv_chunks`` chunks [Q_c | K_c | V_c]
    # (pre-sharded for that many TP ranks; vLLM ``mimo_v2.py`` ``_shard_fp8_qkv_proj``)
    layout: str = "split"
    qkv_chunks: int = 1
    quant_method: str | None = None  # quantization_config.quant_method (dequantized at load)
    # this rank's routed experts [first, stop) under expert parallelism (``mimo_tp``); None: all of them
    expert_range: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        n = len(self.layer_types)
        if n < 1 or len(self.moe_layers) != n or set(self.layer_types) - {FULL_T, SLIDING_T}:
            raise ValueError("layer_types / moe_layers must name every layer")
        if any(self.moe_layers) and (self.n_experts < self.top_k or self.top_k < 1 or self.n_experts % self.n_group):
            raise ValueError("MoE needs n_experts >= top_k >= 1 and n_experts divisible by n_group")
        if self.window < 1:
            raise ValueError("the sliding window must be >= 1")
        if self.mtp_layers < 0:
            raise ValueError(f"num_nextn_predict_layers must be >= 0, got {self.mtp_layers}")
        if self.layout not in ("split", "fused_qkv") or self.qkv_chunks < 1:
            raise ValueError(f"bad attention projection layout {self.layout!r} / {self.qkv_chunks} chunks")

    @property
    def local_experts(self) -> tuple[int, int]:
        """The routed experts this module tree holds, ``[first, stop)``."""
        return self.expert_range or (0, self.n_experts)

    def attn(self, layer: int) -> AttnGeometry:
        return self.sliding if self.layer_types[layer] == SLIDING_T else self.full

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)


class _Reader:
    """Reads keys of one config dict, each error naming the file and the key."""

    def __init__(self, cfg: dict, path: Path):
        self.cfg, self.path = cfg, path

    def fail(self, key: str, why: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: field {key!r} {why}")

    def get(self, key: str, typ, default=...):
        if key not in self.cfg or self.cfg[key] is None:
            if default is ...:
                raise self.fail(key, "is required")
            return default
        v = self.cfg[key]
        if typ is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
            raise self.fail(key, f"must be {typ.__name__}, got {v!r}")
        return v

    def expect(self, key: str, allowed: tuple, default=None) -> None:
        v = self.cfg.get(key, default)
        if v not in allowed:
            raise self.fail(key, f"= {v!r} is not supported (supported: {list(allowed)})")

    def unknown(self, known: set[str]) -> None:
        extra = sorted(k for k in self.cfg if k not in known | _INERT | _MEDIA and not k.endswith("_token_id"))
        if extra:
            raise self.fail(extra[0], f"is not understood by mmserve's MiMo loader (all unknown: {extra})")

    def per_layer(self, key: str, n: int, values: tuple) -> list:
        v = self.get(key, list)
        if len(v) != n or any(x not in values for x in v):
            raise self.fail(key, f"must list one of {list(values)} for each of the {n} layers, got {v!r}")
        return v


def dialect_of(cfg: dict) -> str:
    """``published`` or ``transformers``: which MiMo config dialect ``cfg`` is written in."""
    published = [k for k in ("hybrid_layer_pattern", "swa_num_key_value_heads", "layernorm_epsilon") if k in cfg]
    if published and "layer_types" in cfg:
        return "mixed"
    return "published" if published else "transformers"


def _common(r: _Reader) -> dict:
    r.expect("hidden_act", ("silu",), "silu")
    n_experts = r.get("n_routed_experts", int, 0)
    return dict(
        vocab_size=r.get("vocab_size", int),
        hidden_size=r.get("hidden_size", int),
        intermediate_size=r.get("intermediate_size", int),
        moe_intermediate_size=r.get("moe_intermediate_size", int, 0),
        n_experts=n_experts,
        top_k=r.get("num_experts_per_tok", int, 0),
        n_group=r.get("n_group", int, 1),
        topk_group=r.get("topk_group", int, 1),
        norm_topk_prob=r.get("norm_topk_prob", bool, True),
        routed_scaling_factor=r.get("routed_scaling_factor", float, 1.0),
        attention_bias=r.get("attention_bias", bool, False),
    )


def _rotary(r: _Reader, key: str, head_dim: int, factor: float) -> int:
    dim = int(head_dim * factor)  # as transformers' and vLLM's rope: int(head_dim * partial_rotary_factor)
    if dim < 2 or dim % 2:
        raise r.fail(key, f"= {factor} gives rotary dim {dim} of head dim {head_dim}; it must be even and >= 2")
    return dim


def _from_published(r: _Reader) -> MiMoGeometry:
    r.unknown(_PUBLISHED)
    n = r.get("num_hidden_layers", int)
    pattern = r.per_layer("hybrid_layer_pattern", n, (0, 1))
    freq = r.per_layer("moe_layer_freq", n, (0, 1)) if "moe_layer_freq" in r.cfg else [0] * n
    r.expect("attention_projection_layout", ("split", "fused_qkv"), "split")
    layout = r.cfg.get("attention_projection_layout") or "split"
    scheme = scheme_for(r.cfg.get("quantization_config"), r.path, allowed=("fp8",))  # validates its fields
    r.expect("scoring_func", ("sigmoid",), "sigmoid")
    r.expect("topk_method", ("noaux_tc",), "noaux_tc")
    r.expect("n_shared_experts", (None, 0))
    r.expect("moe_router_dtype", ("float32", "bfloat16"), "float32")
    rs = r.cfg.get("rope_scaling")
    if rs and rs.get("rope_type", rs.get("type", "default")) != "default":
        raise r.fail("rope_scaling", f"= {rs!r}: only default rope is supported")
    factor = r.get("partial_rotary_factor", float, 1.0)
    window = r.get("sliding_window_size", int, None) or r.get("sliding_window", int, None)
    if window is None:
        raise r.fail("sliding_window_size", "is required when hybrid_layer_pattern has sliding layers")
    for alias in ("sliding_window", "attention_chunk_size"):
        if r.cfg.get(alias) not in (None, window):
            raise r.fail(alias, f"= {r.cfg[alias]} disagrees with sliding_window_size = {window}")
    heads, head_dim = r.get("num_attention_heads", int), r.get("head_dim", int)
    swa_dim = r.get("swa_head_dim", int, None) or r.get("swa_qk_head_dim", int, head_dim)
    full = AttnGeometry(
        heads=heads, kv_heads=r.get("num_key_value_heads", int), qk_dim=head_dim,
        v_dim=r.get("v_head_dim", int, head_dim), rope_theta=r.get("rope_theta", float, 1e6),
        rotary_dim=_rotary(r, "partial_rotary_factor", head_dim, factor),
        sinks=r.get("add_full_attention_sink_bias", bool, False))
    sliding = AttnGeometry(
        heads=r.get("swa_num_attention_heads", int, heads), kv_heads=r.get("swa_num_key_value_heads", int),
        qk_dim=swa_dim, v_dim=r.get("swa_v_head_dim", int, full.v_dim),
        rope_theta=r.get("swa_rope_theta", float, full.rope_theta),
        rotary_dim=_rotary(r, "partial_rotary_factor", swa_dim, factor),
        sinks=r.get("add_swa_attention_sink_bias", bool, False))
    chunks = full.kv_heads if layout == "fused_qkv" else 1  # vLLM: ckpt_tp = config.num_key_value_heads
    for kind, a in (("full", full), ("sliding", sliding)):
        if layout == "fused_qkv" and (a.heads % chunks or a.kv_heads % chunks):
            raise r.fail("attention_projection_layout", f"= 'fused_qkv' is stored in num_key_value_heads = {chunks} "
                                                        f"chunks, which do not divide the {kind} layers' {a.heads} "
                                                        f"heads / {a.kv_heads} KV heads")
    return MiMoGeometry(
        dialect="published", layer_types=tuple(SLIDING_T if p else FULL_T for p in pattern),
        layout=layout, qkv_chunks=chunks, quant_method=scheme.method if scheme is not None else None,
        moe_layers=tuple(bool(f) for f in freq), full=full, sliding=sliding, window=window,
        value_scale=r.get("attention_value_scale", float, 1.0), rms_eps=r.get("layernorm_epsilon", float, 1e-6),
        mtp_layers=r.get("num_nextn_predict_layers", int, 0), **_common(r))


def _from_transformers(r: _Reader) -> MiMoGeometry:
    r.unknown(_TRANSFORMERS)
    q = r.cfg.get("quantization_config")
    if q:  # this dialect is served by transformers' own classes, which mmserve runs unquantized
        raise r.fail("quantization_config", f"= {q!r}: quantized weights are served in Xiaomi's published "
                                             "dialect only (hybrid_layer_pattern ...); this file is transformers'")
    n = r.get("num_hidden_layers", int)
    types = r.per_layer("layer_types", n, (FULL_T, SLIDING_T))
    mlp = r.per_layer("mlp_layer_types", n, ("dense", "sparse"))
    rope = r.get("rope_parameters", dict)
    heads, kv, head_dim = r.get("num_attention_heads", int), r.get("num_key_value_heads", int), r.get("head_dim", int)
    v_dim = r.get("v_head_dim", int, head_dim)

    def kind(t: str, kv_heads: int, sinks: bool) -> AttnGeometry:
        p = rope.get(t) if isinstance(rope.get(t), dict) else None
        if p is None or p.get("rope_type", "default") != "default":
            raise r.fail("rope_parameters", f"needs a default-rope entry for {t!r}, got {rope.get(t)!r}")
        return AttnGeometry(heads=heads, kv_heads=kv_heads, qk_dim=head_dim, v_dim=v_dim,
                            rope_theta=float(p["rope_theta"]),
                            rotary_dim=_rotary(r, "rope_parameters", head_dim, float(p.get("partial_rotary_factor", 0.334))),
                            sinks=sinks)

    # transformers' MiMoV2FlashAttention: sliding layers have 2x KV heads and sinks, full none
    return MiMoGeometry(
        dialect="transformers", layer_types=tuple(types), moe_layers=tuple(m == "sparse" for m in mlp),
        full=kind(FULL_T, kv, False), sliding=kind(SLIDING_T, 2 * kv, True), window=r.get("sliding_window", int, 128),
        value_scale=r.get("attention_value_scale", float, 1.0), rms_eps=r.get("rms_norm_eps", float, 1e-5),
        **_common(r))


def mimo_geometry(cfg: dict, path: str | Path = "config.json") -> MiMoGeometry:
    """The geometry of a MiMo config dict (either dialect); ``path`` names the file in errors."""
    r = _Reader(cfg, Path(path))
    d = dialect_of(cfg)
    if d == "mixed":
        raise r.fail("layer_types", "is transformers' dialect but the file also has Xiaomi's published keys "
                                    "(hybrid_layer_pattern / swa_*): write one dialect")
    try:
        return _from_published(r) if d == "published" else _from_transformers(r)
    except ValueError as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{path}: {e}") from e
