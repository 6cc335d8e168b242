"""Deployment arithmetic for a MiMo-V2 config: weight and KV bytes per rank, requests that fit,
and the decode step's HBM-bandwidth bound, per parallel layout (``mmserve plan``).

Everything here is arithmetic on the published geometry, read through the loader's own parser
(``llm_svc.models.geometry.mimo_geometry``), not a measurement. Layouts use vLLM's meanings:
``TP`` splits attention heads and dense MLPs; ``EP`` (``--enable-expert-parallel``) places whole
experts on ``TP x DP`` ranks; ``DP`` replicates attention, each replica with its own requests.

Byte rules (each function states its own):

* FP8 as published (``quantization_config.quant_method = fp8``, 128x128 blocks): a quantized
  ``[R, C]`` linear is ``R*C`` e4m3 bytes + ``ceil(R/128) * ceil(C/128)`` float32 scales, counted
  on the rank's own shard. Quantized: ``qkv_proj`` (or q/k/v), dense MLP and expert gate/up/down.
  Not quantized (bf16): ``o_proj``, embeddings, ``lm_head``, norms, sinks, MTP ``eh_proj``; the
  router in ``moe_router_dtype`` (float32 when absent, as vLLM).
* TP: query heads split; KV heads split, or replicated when TP exceeds them (vLLM
  ``QKVParallelLinear``: ``max(1, kv // tp)`` per rank); ``o_proj`` split by its input;
  dense MLPs column / row split; embeddings and ``lm_head`` split by vocabulary.
* Experts: without EP each expert is split over TP (its intermediate dim); with EP a rank holds
  ``n_experts / (TP x DP)`` whole experts. Router, norms: on every rank.
* KV per token and layer: ``kv_heads_per_rank * (qk_dim + v_dim) * kv_dtype_bytes`` (K and V);
  a request of ``L`` tokens holds ``L`` on full layers and ``min(L, window)`` on sliding layers
  (the point of the hybrid design: mmserve releases out-of-window SWA slots as the model runs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the geometry reader imports torch: only ``read_config`` / ``layer_counts`` need it
    from llm_svc.models.geometry import AttnGeometry, MiMoGeometry

GIB = 2**30
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class GPU:
    """One accelerator: HBM capacity (the total ``nvidia-smi`` reports: the vendor's "80 GB" and
    "141 GB" are binary units) and HBM bandwidth as the vendor publishes it."""

    name: str
    hbm_bytes: int
    bandwidth: float  # bytes / s


GPUS = {
    "h100": GPU("H100 SXM 80 GB", 81559 * 2**20, 3.35e12),
    "h200": GPU("H200 141 GB", 143771 * 2**20, 4.8e12),
}


@dataclass(frozen=True)
class Layout:
    """A parallel layout in vLLM's terms: ``tp`` x ``dp`` ranks; ``ep``: experts placed whole on
    all ``tp * dp`` ranks (EP size = TP x DP), else each expert split over TP."""

    tp: int
    dp: int = 1
    ep: bool = False

    def __post_init__(self) -> None:
        if self.tp < 1 or self.dp < 1:
            raise ValueError(f"bad layout {self}")
        if self.dp > 1 and not self.ep:
            raise ValueError("DP > 1 is planned with expert parallelism only (vLLM's DP x TP + EP)")

    @property
    def ranks(self) -> int:
        return self.tp * self.dp

    @property
    def ep_size(self) -> int:
        return self.ranks if self.ep else 1

    @property
    def name(self) -> str:
        parts = ([f"DP{self.dp}"] if self.dp > 1 else []) + [f"TP{self.tp}"]
        return " ".join(parts + ([f"EP{self.ep_size}"] if self.ep else []))


def layouts_for(gpus: int) -> list[Layout]:
    """TP = N; TP = N with EP; then DP x TP with EP for every other divisor TP of N."""
    if gpus < 1:
        raise ValueError("--gpus must be >= 1")
    out = [Layout(gpus)]
    if gpus > 1:
        out.append(Layout(gpus, ep=True))
        out += [Layout(t, gpus // t, ep=True) for t in range(gpus - 1, 0, -1) if gpus % t == 0]
    return out


@dataclass(frozen=True)
class Precision:
    """Stored bytes: ``fp8`` linears with ``block`` scales (or none: all ``dense_bytes``),
    ``dense_bytes`` for unquantized tensors, ``router_bytes`` for the MoE gate, ``kv_bytes`` per
    cached element."""

    fp8: bool
    block: tuple[int, int] = (128, 128)
    dense_bytes: int = 2
    router_bytes: int = 4
    kv_bytes: int = 2


def read_config(path: str | Path) -> tuple[MiMoGeometry, dict]:
    """The geometry (through the loader's parser) and raw dict of ``path`` (a file or a bundle dir)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    cfg = json.loads(p.read_text())
    from llm_svc.models.geometry import mimo_geometry

    return mimo_geometry(cfg, p), cfg


def precision_for(cfg: dict, weights: str = "auto", kv_dtype: str = "bf16") -> Precision:
    """``weights``: ``auto`` (FP8 when the config's ``quantization_config`` says so), ``fp8``, ``bf16``."""
    q = cfg.get("quantization_config") or {}
    fp8 = q.get("quant_method") == "fp8" if weights == "auto" else weights == "fp8"
    block = tuple(q.get("weight_block_size") or (128, 128))
    return Precision(fp8=fp8, block=(int(block[0]), int(block[1])),
                     router_bytes=DTYPE_BYTES[cfg.get("moe_router_dtype") or "float32"],
                     kv_bytes=DTYPE_BYTES[kv_dtype])


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def linear_bytes(rows: int, cols: int, p: Precision, quantized: bool = True) -> int:
    """A ``[rows, cols]`` weight as stored: e4m3 bytes + one float32 scale per block when
    ``quantized`` and the checkpoint is FP8, else ``rows * cols * dense_bytes``."""
    if quantized and p.fp8:
        return rows * cols + _cdiv(rows, p.block[0]) * _cdiv(cols, p.block[1]) * 4
    return rows * cols * p.dense_bytes


def kv_heads_per_rank(kv_heads: int, tp: int) -> int:
    """KV heads a TP rank holds: split, or one replicated head when TP exceeds them (vLLM)."""
    return max(1, kv_heads // tp)


def attention_bytes(a: AttnGeometry, hidden: int, tp: int, p: Precision) -> int:
    """One attention block on one TP rank: q/k/v rows of its heads (FP8), ``o_proj`` over its
    heads' V dims (bf16, as published), sink biases of its heads."""
    heads, kvh = a.heads // tp, kv_heads_per_rank(a.kv_heads, tp)
    qkv = linear_bytes(heads * a.qk_dim + kvh * (a.qk_dim + a.v_dim), hidden, p)
    o = linear_bytes(hidden, heads * a.v_dim, p, quantized=False)
    return qkv + o + (heads * p.dense_bytes if a.sinks else 0)


def dense_mlp_bytes(hidden: int, inter: int, tp: int, p: Precision) -> int:
    """A SwiGLU MLP on one TP rank: gate and up ``[inter/tp, hidden]``, down ``[hidden, inter/tp]``."""
    shard = inter // tp
    return 2 * linear_bytes(shard, hidden, p) + linear_bytes(hidden, shard, p)


def expert_bytes(hidden: int, inter: int, p: Precision) -> int:
    """One routed expert (or its TP shard of ``inter`` rows): gate, up, down."""
    return 2 * linear_bytes(inter, hidden, p) + linear_bytes(hidden, inter, p)


def expert_shard_bytes(g: MiMoGeometry, layout: Layout, p: Precision) -> int:
    """Bytes of one expert as one rank holds it: whole under EP, its 1/TP slice without."""
    inter = g.moe_intermediate_size if layout.ep else g.moe_intermediate_size // layout.tp
    return expert_bytes(g.hidden_size, inter, p)


def kv_bytes_per_token(a: AttnGeometry, tp: int, p: Precision) -> int:
    """KV bytes one token costs on one layer of kind ``a``, on one TP rank (K and V)."""
    return kv_heads_per_rank(a.kv_heads, tp) * (a.qk_dim + a.v_dim) * p.kv_bytes


@dataclass(frozen=True)
class RankWeights:
    """Weight bytes on one rank, by part (``mtp``: the MTP draft layers, loaded for MTP decoding)."""

    embed: int
    lm_head: int
    attention: int
    dense_mlp: int
    router: int
    experts: int
    norms: int
    mtp: int

    @property
    def total(self) -> int:
        return (self.embed + self.lm_head + self.attention + self.dense_mlp + self.router + self.experts
                + self.norms + self.mtp)

    @property
    def read_per_step_static(self) -> int:
        """Read by every decode step whatever the batch: all but the embedding table (a few rows
        are gathered), the experts (only those routed to) and the MTP layers (plain decoding)."""
        return self.lm_head + self.attention + self.dense_mlp + self.router + self.norms


def rank_weights(g: MiMoGeometry, layout: Layout, p: Precision, tie_embeddings: bool = False,
                 mtp: bool = True) -> RankWeights:
    """Weight bytes of one rank of ``layout`` (see the module docstring for the rules)."""
    h, tp = g.hidden_size, layout.tp
    vocab_shard = _cdiv(g.vocab_size, tp)
    embed = vocab_shard * h * p.dense_bytes
    attn = sum(attention_bytes(g.attn(i), h, tp, p) for i in range(g.num_layers))
    n_moe = sum(g.moe_layers)
    dense = (g.num_layers - n_moe) * dense_mlp_bytes(h, g.intermediate_size, tp, p)
    router = n_moe * (g.n_experts * h + g.n_experts) * p.router_bytes
    local = g.n_experts // layout.ep_size if layout.ep else g.n_experts
    experts = n_moe * local * expert_shard_bytes(g, layout, p)
    norms = (2 * g.num_layers + 1) * h * p.dense_bytes
    mtp_bytes = 0
    if mtp and g.mtp_layers:
        one = (attention_bytes(g.sliding, h, tp, p) + dense_mlp_bytes(h, g.intermediate_size, tp, p)
               + linear_bytes(h, 2 * h, p, quantized=False) + 5 * h * p.dense_bytes)
        mtp_bytes = g.mtp_layers * one
    return RankWeights(embed=embed, lm_head=0 if tie_embeddings else embed, attention=attn, dense_mlp=dense,
                       router=router, experts=experts, norms=norms, mtp=mtp_bytes)


def layer_counts(g: MiMoGeometry) -> tuple[int, int]:
    """(full-attention layers, sliding layers)."""
    from llm_svc.models.geometry import FULL_T

    n_full = sum(t == FULL_T for t in g.layer_types)
    return n_full, g.num_layers - n_full


def request_kv_bytes(g: MiMoGeometry, tp: int, p: Precision, tokens: int) -> int:
    """KV bytes one request of ``tokens`` holds on one TP rank: every token on the full layers, at
    most the window on the sliding layers."""
    n_full, n_swa = layer_counts(g)
    return (n_full * tokens * kv_bytes_per_token(g.full, tp, p)
            + n_swa * min(tokens, g.window) * kv_bytes_per_token(g.sliding, tp, p))


def requests_that_fit(kv_budget: int, per_request: int) -> int:
    """Whole requests of ``per_request`` bytes in ``kv_budget`` bytes (0 when the budget is negative)."""
    return max(0, kv_budget) // per_request if per_request else 0


def expected_active_experts(n_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts one MoE layer reads for ``tokens`` tokens, each routed to ``top_k`` of
    ``n_experts`` uniformly at random: ``E * (1 - (1 - k/E) ** tokens)`` (real routing is skewed;
    this is the bandwidth the step cannot avoid on balanced load)."""
    if tokens <= 0 or not n_experts:
        return 0.0
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** tokens)


def decode_step_bytes(g: MiMoGeometry, layout: Layout, p: Precision, w: RankWeights, requests: int, tokens: int,
                      context: int) -> float:
    """HBM bytes one rank reads in one decode step: its static weights, its experts that the
    step's ``tokens`` are routed to (under EP the tokens of every DP replica reach every rank's
    experts), and the KV of the ``requests`` its replica runs at ``context`` tokens each."""
    active = expected_active_experts(g.n_experts, g.top_k, tokens)
    local_active = active / layout.ep_size if layout.ep else active
    experts = sum(g.moe_layers) * local_active * expert_shard_bytes(g, layout, p)
    kv = requests * request_kv_bytes(g, layout.tp, p, context)
    return w.read_per_step_static + experts + kv


def shape_problems(g: MiMoGeometry, layout: Layout, p: Precision) -> list[str]:
    """Why the model's shapes do not split over ``layout`` (empty: they do), as vLLM checks them."""
    tp, out = layout.tp, []
    for kind, a in (("full", g.full), ("sliding", g.sliding)):
        if a.heads % tp:
            out.append(f"{kind} layers' {a.heads} query heads do not divide over TP {tp}")
        if a.kv_heads % tp and tp % a.kv_heads:
            out.append(f"{kind} layers' {a.kv_heads} KV heads neither divide TP {tp} nor are divided by it")
    if g.layout == "fused_qkv" and g.qkv_chunks % tp:
        out.append(f"fused qkv_proj is stored in {g.qkv_chunks} TP chunks; TP {tp} does not divide them")
    if g.intermediate_size % tp or (p.fp8 and (g.intermediate_size // tp) % p.block[0]):
        out.append(f"dense MLP width {g.intermediate_size} / TP {tp} is not a whole number of "
                   f"{p.block[0]}-row FP8 blocks" if p.fp8 else f"dense MLP width {g.intermediate_size} / TP {tp}")
    if any(g.moe_layers):
        if layout.ep and g.n_experts % layout.ep_size:
            out.append(f"{g.n_experts} experts do not divide over EP {layout.ep_size}")
        inter = g.moe_intermediate_size
        if not layout.ep and (inter % tp or (p.fp8 and (inter // tp) % p.block[0])):
            out.append(f"expert width {inter} / TP {tp} is not a whole number of {p.block[0]}-row FP8 blocks")
    return out


@dataclass(frozen=True)
class LayoutPlan:
    """One layout's numbers (bytes are per rank; requests and tok/s for the whole deployment)."""

    layout: Layout
    problems: tuple[str, ...]
    weights: RankWeights
    kv_full_per_token: int  # all full-attention layers, one token, one rank
    kv_swa_per_token: int  # all sliding layers, one token, one rank (held for at most the window)
    kv_budget: int  # HBM left for KV on one rank
    fits: dict[int, int]  # context tokens -> requests that fit in the deployment
    step_bytes_b1: float
    step_s_b1: float
    batch: int  # requests at the first context that fit (deployment)
    step_bytes_batch: float
    step_s_batch: float

    @property
    def status(self) -> str:
        if self.problems:
            return "does not divide"
        return "ok" if self.kv_budget > 0 and self.batch > 0 else "does not fit"


def plan_layout(g: MiMoGeometry, layout: Layout, p: Precision, gpu: GPU, contexts: tuple[int, ...],
                reserve: int, utilization: float = 0.9, tie_embeddings: bool = False,
                mtp: bool = True) -> LayoutPlan:
    """All numbers of one layout: HBM for KV = ``utilization * HBM - weights - reserve`` per rank."""
    w = rank_weights(g, layout, p, tie_embeddings, mtp)
    n_full, n_swa = layer_counts(g)
    kv_budget = int(utilization * gpu.hbm_bytes) - w.total - reserve
    fits = {c: layout.dp * requests_that_fit(kv_budget, request_kv_bytes(g, layout.tp, p, c)) for c in contexts}
    batch = fits[contexts[0]]
    b1 = decode_step_bytes(g, layout, p, w, 1, 1, contexts[0])  # one request in the deployment
    per_dp = batch // layout.dp
    bb = decode_step_bytes(g, layout, p, w, per_dp, batch, contexts[0]) if batch else 0.0
    return LayoutPlan(
        layout=layout, problems=tuple(shape_problems(g, layout, p)), weights=w,
        kv_full_per_token=n_full * kv_bytes_per_token(g.full, layout.tp, p),
        kv_swa_per_token=n_swa * kv_bytes_per_token(g.sliding, layout.tp, p),
        kv_budget=kv_budget, fits=fits, step_bytes_b1=b1, step_s_b1=b1 / gpu.bandwidth,
        batch=batch, step_bytes_batch=bb, step_s_batch=bb / gpu.bandwidth)
