"""Gated MLPs with their gate and up projections in one weight, and routed experts as one pass.

``GatedMLP``: ``down(act(x W_g^T) * (x W_u^T))`` as two GEMMs instead of three (``W_g`` and
``W_u`` stacked into one ``[2I, H]`` weight).

``RoutedExperts``: every expert's stacked weights ``gate_up [E, 2I, H]``, ``down [E, H, I]``
(transformers' own MoE layout); a forward sorts the ``T * K`` (token, expert) pairs by expert
once (one host sync for the counts), gathers the tokens into expert-contiguous rows and runs
two GEMMs per expert that has tokens on those rows, then scales by the routing weights and sums
each token's ``K`` rows back with one ``index_add_``. Per expert no mask, ``nonzero`` or ``where``
(transformers' loop pays those per expert, which is most of a decode step's MoE time on CPU).
SiLU-gated experts on the CPU skip even that: the whole layer is one C call on packed weights
(``cpu_packed``: the tokens' rows read in place, SiLU on the accumulators, the weighted sum added
into each token's row), for a decode step's tokens and a prefill chunk's alike. vs_vllm MiMo
checkpoint (hidden 512, 8 experts of 256, top-2), 2 threads, 2-core AVX-512 EPYC, one layer:
320 tokens 3.9-4.2 -> 2.6 ms (~190 GFLOP/s against oneDNN's ~125), 2,048 20.3 -> 17.0 ms; seven
distinct layers of 4 tokens (a decode step's, weights streamed) 1.78 -> 1.10 ms against the
few-row kernel. Shapes it does not pack (I not a multiple of its vector width, H of twice it) keep
the few-row kernel (``cpu_gemv.moe``) for a decode step's tokens and oneDNN per expert above.

Experts kept in their checkpoint's width (FP8 / MXFP4 modules loaded packed, ``qweight``) or
served at bfloat16 run the same C call on ``qweight.PackedExperts`` (``cpu_packed.moe_w``: the
kernel's build for that format widens each weight tile in registers; activations float32, a
bfloat16 input widened and the output rounded back inside the call). Loaded-packed experts
are stacked one expert at a time and each expert module's ``qweight`` is dropped as it is
stacked (one copy); where they cannot run packed (an activation other than SiLU, a shape the
kernel does not take) they are widened with ``qweight.dense`` instead.

Packing keeps one copy of the stacked weights: the modules' own parameters are rebound as views
of the stacked tensors, so the loaded model and its ``state_dict`` are unchanged. The GEMMs run
on the ``linear`` backend (``linear.make_linear``: oneDNN on CPU by default, which holds its own
reordered copy).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_gemv, cpu_packed, qweight
from .linear import (AMX_MIN_ROWS, DenseOfPacked, Linear, amx_shape, amx_splits, join_packed, make_linear, resolve,
                     row_bucket, stack_linears)
from .qweight import PackedExperts, PackedWeight


def _is_silu(act) -> bool:
    return act is F.silu or type(act) is nn.SiLU or type(act).__name__ == "SiLUActivation"


def _is_gelu_tanh(act) -> bool:
    """transformers' ``gelu_pytorch_tanh`` (``GELUTanh`` / ``PytorchGELUTanh``: the formula, in
    torch or in Python), ``nn.GELU(approximate="tanh")`` or ``partial(F.gelu, approximate="tanh")``."""
    if type(act).__name__ in ("GELUTanh", "PytorchGELUTanh"):
        return True
    if type(act) is nn.GELU:
        return act.approximate == "tanh"
    return isinstance(act, functools.partial) and act.func is F.gelu and act.keywords == {"approximate": "tanh"} \
        and not act.args


def act_kind(act) -> str | None:
    """``"silu"`` / ``"gelu_tanh"`` for the activations with a fused C pass, else None."""
    return "silu" if _is_silu(act) else "gelu_tanh" if _is_gelu_tanh(act) else None


def _gated(gu: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor], kind: str | None) -> torch.Tensor:
    """``act(gate) * up`` of a fused projection ``gu [T, 2I]``: one C pass for SiLU and tanh-GELU
    on the CPU (``kind``: ``act_kind(act)``; two eager ops and a temporary otherwise)."""
    if kind is not None and cpu_gemv.supports_gated_mul(gu):
        return cpu_gemv.silu_mul(gu) if kind == "silu" else cpu_gemv.gelu_tanh_mul(gu)
    gate, up = gu.chunk(2, dim=-1)  # [T, I] each
    return act(gate) * up


def _rebind(module: nn.Module, name: str, view: torch.Tensor) -> None:
    setattr(module, name, nn.Parameter(view, requires_grad=False))


@dataclass
class GatedMLP:
    gate_up: torch.Tensor | PackedWeight  # [2I, H]
    down: torch.Tensor | PackedWeight  # [H, I]
    act: Callable[[torch.Tensor], torch.Tensor]
    backend: str = "auto"  # linear backend (``linear.BACKENDS``)

    def __post_init__(self) -> None:
        self._gate_up: Linear = make_linear(self.gate_up, backend=self.backend)
        self._down: Linear = make_linear(self.down, backend=self.backend)
        self._act = act_kind(self.act)

    @classmethod
    def pack(cls, mlp: nn.Module, act: Callable | None = None, backend: str = "auto") -> "GatedMLP":
        """From a module with ``gate_proj`` / ``up_proj`` / ``down_proj`` linears (no biases)."""
        if any(getattr(mlp, n).bias is not None for n in ("gate_proj", "up_proj", "down_proj")):
            raise ValueError("GatedMLP packs bias-free projections only")
        act = act or getattr(mlp, "act_fn", F.silu)
        if getattr(mlp.gate_proj, "qweight", None) is not None or getattr(mlp.gate_proj, "qweight_joined", None) is not None:  # kept packed at load
            gu, _ = join_packed([mlp.gate_proj, mlp.up_proj])
            return cls(gu, mlp.down_proj.qweight, act, backend)
        gu, _ = stack_linears([mlp.gate_proj, mlp.up_proj])
        return cls(gu, mlp.down_proj.weight, act, backend)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._down(_gated(self._gate_up(x), self.act, self._act))


@dataclass
class RoutedExperts:
    gate_up: torch.Tensor | None  # [E, 2I, H] (None: only ``packed``)
    down: torch.Tensor | None  # [E, H, I]
    act: Callable[[torch.Tensor], torch.Tensor]
    backend: str = "auto"  # linear backend (``linear.BACKENDS``)
    packed: PackedExperts | None = None  # experts kept packed at load (SiLU-gated, CPU)

    def __post_init__(self) -> None:
        # SiLU-gated experts on the CPU backends: the whole layer in one C call (the per-expert
        # Python loop below was ~10% of a decode step), on packed weights where the shape packs
        self._act = act_kind(self.act)
        self._packed = None
        self._linears: tuple[list[Linear], list[Linear]] | None = None  # per-expert GEMMs, made on first use
        # bfloat16 on a CPU with AMX: calls whose experts average AMX_MIN_ROWS rows (prefill
        # chunks) run expert by expert through F.linear on the stacked weights (oneDNN's AMX
        # GEMM, ``linear.AmxSplitLinear``'s reasons); fewer rows stay in the one packed C call
        self._amx: tuple[list[Linear], list[Linear]] | None = None
        if self.gate_up is not None and amx_splits(self.backend, self.gate_up[0]):
            self._amx = ([functools.partial(F.linear, weight=g) for g in self.gate_up],
                         [functools.partial(F.linear, weight=d) for d in self.down])
            # their primitives built at start-up (``linear.warm_buckets``): one expert stands for all
            e, i2, h = self.gate_up.shape
            self._amx_shapes = (amx_shape(("experts_gate_up", h, i2, self.gate_up.dtype), self._amx[0][0], h,
                                          self.gate_up.dtype),
                                amx_shape(("experts_down", i2 // 2, h, self.down.dtype), self._amx[1][0], i2 // 2,
                                          self.down.dtype))
        if self.packed is not None:
            if self._act != "silu":
                raise ValueError("packed experts are SiLU-gated; widen them (qweight.dense) for another activation")
            self._few_rows = False
            return
        kind = resolve(self.backend, self.gate_up[0])  # one expert's [2I, H] stands for them all
        self._few_rows = kind in ("packed", "onednn") and self._act == "silu"
        if kind == "packed" and self._few_rows and self.gate_up.dtype == torch.float32:
            self._packed = cpu_packed.pack(self.gate_up, self.down) \
                if cpu_packed.packable(self.gate_up, self.down) else None
        elif kind == "packed" and self._few_rows and self.gate_up.dtype == torch.bfloat16:
            e, i2, h = self.gate_up.shape
            if qweight.experts_packable("bfloat16", h, i2 // 2) and tuple(self.down.shape) == (e, h, i2 // 2):
                self.packed = qweight.pack_experts(e, lambda j: qweight.pack("bfloat16", self.gate_up[j]),
                                                   lambda j: qweight.pack("bfloat16", self.down[j]))

    @classmethod
    def pack(cls, experts: nn.Module, act: Callable | None = None, backend: str = "auto") -> "RoutedExperts":
        """From transformers' stacked experts (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``)
        or a ``ModuleList`` of gated MLP modules (mmserve's published-layout tree)."""
        if hasattr(experts, "gate_up_proj"):
            return cls(experts.gate_up_proj, experts.down_proj, act or experts.act_fn, backend)
        if getattr(experts, "packed_experts", None) is not None:  # stacked before (a second model over one tree)
            return cls(None, None, act or F.silu, backend, packed=experts.packed_experts)
        if getattr(experts[0].gate_proj, "qweight", None) is not None:
            return cls._from_packed_modules(experts, act or F.silu, backend)
        gu = torch.stack([torch.cat([e.gate_proj.weight.detach(), e.up_proj.weight.detach()], 0)
                          for e in experts]).contiguous()  # [E, 2I, H]
        dn = torch.stack([e.down_proj.weight.detach() for e in experts]).contiguous()  # [E, H, I]
        i = gu.shape[1] // 2
        for j, e in enumerate(experts):
            _rebind(e.gate_proj, "weight", gu[j, :i])
            _rebind(e.up_proj, "weight", gu[j, i:])
            _rebind(e.down_proj, "weight", dn[j])
        return cls(gu, dn, act or F.silu, backend)

    @classmethod
    def _from_packed_modules(cls, experts: nn.Module, act: Callable, backend: str) -> "RoutedExperts":
        """Experts whose projections were kept packed at load: stacked one expert at a time,
        each module's ``qweight`` dropped as it goes; widened (``qweight.dense``) where they
        cannot run packed."""
        first = experts[0]
        fmt, h, i = first.gate_proj.qweight.fmt, first.gate_proj.qweight.k, first.gate_proj.qweight.n
        if act_kind(act) == "silu" and qweight.experts_packable(fmt, h, i):
            def gate_up(j: int) -> PackedWeight:
                e = experts[j]
                w = qweight.concat([e.gate_proj.qweight, e.up_proj.qweight])
                e.gate_proj.qweight = e.up_proj.qweight = None
                return w

            def down(j: int) -> PackedWeight:
                w, experts[j].down_proj.qweight = experts[j].down_proj.qweight, None
                return w

            experts.packed_experts = qweight.pack_experts(len(experts), gate_up, down)
            for j, e in enumerate(experts):  # where state_dict finds each one's weight now
                for part in ("gate", "up", "down"):
                    m = getattr(e, part + "_proj")
                    m.qweight_expert = (experts.packed_experts, j, part)
                    m.forward = DenseOfPacked(m)
            return cls(None, None, act, backend, packed=experts.packed_experts)
        for e in experts:  # the float weights the other paths read
            for m in (e.gate_proj, e.up_proj, e.down_proj):
                _rebind(m, "weight", qweight.dense(m.qweight))
                m.qweight = None
        return cls.pack(experts, act, backend)

    @property
    def num_experts(self) -> int:
        return self.packed.num_experts if self.packed is not None else self.gate_up.shape[0]

    def __call__(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [T, H]; idx [T, K] chosen experts; w [T, K] their weights -> [T, H] in x's dtype."""
        if self._amx is not None and x.dim() == 2 and idx.numel() >= AMX_MIN_ROWS * self.num_experts:
            # rows padded to ``row_bucket``: oneDNN builds a primitive per row count (a few ms
            # each) and caches it by shape
            return self._per_expert(x, idx, w, *self._amx, pad=row_bucket)
        if self.packed is not None:
            if x.dtype in cpu_packed.ACT_DTYPES:  # bfloat16 widened and rounded inside the call
                return cpu_packed.moe_w(x, idx, w, self.packed)
            return cpu_packed.moe_w(x.float(), idx, w, self.packed).to(x.dtype)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.grouped(x, idx, w)
        if self._packed is not None and x.dtype == torch.float32 and x.dim() == 2:
            return cpu_packed.moe(x, idx, w, self._packed)
        if self._few_rows and cpu_gemv.supports_moe(x, self.gate_up, self.down):
            return cpu_gemv.moe(x, idx, w, self.gate_up, self.down)
        if self._linears is None:
            self._linears = ([make_linear(w, backend=self.backend) for w in self.gate_up],
                             [make_linear(w, backend=self.backend) for w in self.down])
        return self._per_expert(x, idx, w, *self._linears)

    def _per_expert(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gate_ups: list[Linear],
                    downs: list[Linear], pad: Callable[[int], int] | None = None) -> torch.Tensor:
        """``__call__``'s product one expert at a time: the (token, expert) pairs grouped by
        expert, each group through ``gate_ups[e]`` and ``downs[e]``. ``pad``: each expert's group
        runs as ``pad(rows)`` rows, zero rows after its own (the pairs gathered once into one
        padded buffer)."""
        t, k = idx.shape
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # [T*K]: pairs grouped by expert, token order inside
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tok = order // k
        sizes = counts if pad is None else [pad(c) if c else 0 for c in counts]
        dest = None  # each sorted pair's row in the padded buffer (None: no padding)
        if sizes == counts:
            xs = x.index_select(0, tok)  # [T*K, H]
        else:
            shift, gaps = 0, []  # rows of padding before each expert's group
            for c, size in zip(counts, sizes):
                gaps.append(shift)
                shift += size - c
            dest = torch.arange(t * k) + torch.tensor(gaps).repeat_interleave(torch.tensor(counts), output_size=t * k)
            xs = x.new_zeros(sum(sizes), x.shape[1])  # [P, H]
            xs.index_copy_(0, dest, x.index_select(0, tok))
        ys = torch.empty_like(xs)
        start = 0
        for e, size in enumerate(sizes):
            if size:
                ys[start:start + size] = downs[e](_gated(gate_ups[e](xs[start:start + size]), self.act, self._act))
                start += size
        if dest is not None:
            ys = ys.index_select(0, dest)  # [T*K, H]
        ys.mul_(w.reshape(-1).index_select(0, order).to(ys.dtype)[:, None])
        return torch.zeros_like(x).index_add_(0, tok, ys)

    def grouped(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The same product as ``__call__`` with no host sync (what a CUDA graph can record): the
        (token, expert) pairs sorted by expert on the device, each expert's group ended by a
        ``searchsorted`` over the sorted ids, and both GEMMs as one ``torch._grouped_mm`` each."""
        t, k = idx.shape
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # [T*K]
        experts = torch.arange(self.num_experts, device=x.device, dtype=flat.dtype)
        ends = torch.searchsorted(flat.index_select(0, order), experts, right=True).to(torch.int32)  # [E]
        tok = order // k
        xs = x.index_select(0, tok)  # [T*K, H]
        gu = torch._grouped_mm(xs, self.gate_up.transpose(1, 2), offs=ends)  # [T*K, 2I]
        ys = torch._grouped_mm(_gated(gu, self.act, self._act), self.down.transpose(1, 2), offs=ends)  # [T*K, H]
        ys = ys * w.reshape(-1).index_select(0, order).to(ys.dtype)[:, None]
        return torch.zeros_like(x).index_add_(0, tok, ys)
