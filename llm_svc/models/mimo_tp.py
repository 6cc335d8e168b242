"""MiMo-V2 split over tensor- and expert-parallel ranks: the geometry one rank builds, and which
rows or columns of each stored tensor it reads (Megatron's split, as vLLM's ``mimo_v2_flash.py``):

* attention: query heads split evenly; KV heads split with them, or, when there are fewer KV
  heads than ranks, each rank holds the one KV head its query heads read (vLLM replicates them
  the same way); ``q/k/v_proj`` by rows (a fused ``qkv_proj`` is de-interleaved first), sinks by
  head, ``o_proj`` by columns (its partial sums are all-reduced). Full and sliding layers split
  their own head counts.
* dense MLPs: ``gate/up_proj`` by rows, ``down_proj`` by columns (all-reduced).
* routed experts, tensor-parallel: every expert's ``gate/up`` rows and ``down`` columns split as a
  dense MLP's; expert-parallel: whole experts per rank, ``[r E/P, (r+1) E/P)``, stored under their
  local index. The router (``gate.weight``, ``e_score_correction_bias``) is on every rank, so
  routing is computed once per rank from the same all-reduced input and is the same everywhere.
* embedding, norms, ``lm_head``: whole on every rank; the MTP layers whole on rank 0 only (it
  drafts; the drafts are verified by the split model).

FP8 block scales split with their blocks: rows keep each row's scale row; a column split must
fall on 128-column block edges (``qweight.pack(cols=)``)."""

from __future__ import annotations

import dataclasses
import re

from llm_svc.parallel import ParallelConfig, even_range

from .geometry import AttnGeometry, MiMoGeometry

_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(\d+)(\..*)")
_ATTN = re.compile(r"model\.layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|o_proj|attention_sink_bias)(\.\w+)?")
_MLP = re.compile(r"model\.layers\.(\d+)\.mlp\.(?:experts\.\d+\.)?(gate_proj|up_proj|down_proj)\.(weight|bias)")

FP8_BLOCK = 128  # columns of one FP8 scale block: a column split falls on their edges


def _kv_heads(a: AttnGeometry, tp: int, kind: str) -> int:
    if a.heads % tp:
        raise ValueError(f"the {kind} layers' {a.heads} attention heads do not split over {tp} ranks")
    if a.kv_heads % tp and tp % a.kv_heads:
        raise ValueError(f"the {kind} layers' {a.kv_heads} KV heads neither split over nor replicate to {tp} ranks")
    return max(1, a.kv_heads // tp)


class MiMoShard:
    """Rank ``rank``'s part of a MiMo of geometry ``g`` under ``par``."""

    def __init__(self, g: MiMoGeometry, par: ParallelConfig, rank: int):
        self.g, self.par, self.rank = g, par, rank
        self.tp = tp = par.tensor_parallel_size
        self.ep = par.expert_parallel_size
        full = dataclasses.replace(g.full, heads=g.full.heads // tp, kv_heads=_kv_heads(g.full, tp, "full"))
        sliding = dataclasses.replace(g.sliding, heads=g.sliding.heads // tp,
                                      kv_heads=_kv_heads(g.sliding, tp, "sliding"))
        inter = g.intermediate_size
        if any(not m for m in g.moe_layers):
            inter = _span(even_range(g.intermediate_size, tp, rank, what="intermediate_size"))
        moe_inter, experts = g.moe_intermediate_size, None
        if any(g.moe_layers):
            if self.ep > 1:
                experts = even_range(g.n_experts, self.ep, rank, what="n_routed_experts")
            else:
                moe_inter = _span(even_range(g.moe_intermediate_size, tp, rank, what="moe_intermediate_size"))
        # the MTP layers are not split: rank 0 holds them whole (``keeps_mtp``) and drafts alone
        # (a draft costs about one decoder layer; every draft is verified by the split model)
        self.keeps_mtp = rank == 0 and g.mtp_layers > 0
        self.geometry = dataclasses.replace(g, full=full, sliding=sliding, intermediate_size=inter,
                                            moe_intermediate_size=moe_inter, expert_range=experts, mtp_layers=0)

    def rename(self, name: str) -> str | None:
        """A module name (after the checkpoint's renames) -> this rank's, or None where this rank
        does not hold it (another rank's expert; the MTP layers)."""
        if name.startswith("model.mtp."):
            return name if self.keeps_mtp else None
        m = _EXPERT.fullmatch(name)
        if m is None or self.ep == 1:
            return name
        first, stop = self.geometry.local_experts
        e = int(m.group(2))
        return f"{m.group(1)}{e - first}{m.group(3)}" if first <= e < stop else None

    def slice(self, target: str) -> tuple[int, int, int] | None:
        """``(dim, start, stop)`` of module tensor ``target`` that this rank holds; None: all of it."""
        m = _ATTN.fullmatch(target)
        if m is not None:
            a = self.g.attn(int(m.group(1)))
            part, tp = m.group(2), self.tp
            heads = even_range(a.heads, tp, self.rank)
            if part == "attention_sink_bias":
                return 0, *heads
            if part == "q_proj":
                return 0, heads[0] * a.qk_dim, heads[1] * a.qk_dim
            if part == "o_proj":
                return 1, heads[0] * a.v_dim, heads[1] * a.v_dim
            dim = a.qk_dim if part == "k_proj" else a.v_dim
            if a.kv_heads >= tp:
                kv0, kv1 = even_range(a.kv_heads, tp, self.rank)
            else:  # fewer KV heads than ranks: the one this rank's query heads read
                kv0 = heads[0] // (a.heads // a.kv_heads)
                kv1 = kv0 + 1
            return 0, kv0 * dim, kv1 * dim
        m = _MLP.fullmatch(target)
        if m is None or self.tp == 1:
            return None
        expert = ".experts." in target
        if expert and self.ep > 1:
            return None  # whole experts
        inter = self.g.moe_intermediate_size if expert else self.g.intermediate_size
        r0, r1 = even_range(inter, self.tp, self.rank)
        return (1, r0, r1) if m.group(2) == "down_proj" and m.group(3) == "weight" else (0, r0, r1)


def _span(r: tuple[int, int]) -> int:
    return r[1] - r[0]
