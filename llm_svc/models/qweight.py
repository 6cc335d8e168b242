"""Weights kept in their stored width, packed for the CPU kernels (``cpu_packed``, one build per
format: ``w_elem.h``): bfloat16, FP8 e4m3 with block scales (MiMo-V2-Flash / DeepSeek-V3) and
MXFP4 (gpt-oss). The kernels widen each tile row to float32 in registers, so a decode step
streams 2, 1 or 0.53 bytes per weight instead of 4.

``pack`` turns one stored weight ``[N, K]`` (as read from the checkpoint: e4m3 + ``scale_inv``,
MXFP4 blocks + scales, bfloat16 or float32) into a ``PackedWeight`` of ``ceil(N / 2VL)`` tiles
``[K][2VL]``; ``pack_experts`` does it for every expert of a MoE layer into one stacked copy,
one expert at a time (the stored tensors are never widened as a whole). Packed sizes: FP8 1 byte
a weight + a float32 scale per (column, 128-deep K group) (~3%); MXFP4 1/2 + 1/32 byte; bfloat16 2.

FP8 scale grids: a row's scale row is ``quant.fp8_scale_rows`` (the ``row_groups`` form of a
fused ``qkv_proj``, whose grid restarts per row chunk, included), spread to one scale per column
at pack time, so a tile whose columns straddle two scale blocks needs nothing special. Only
128-deep K blocks pack (the kernel's group); other block sizes stay on the dequantize-at-load path
(``fp8_packable``). The stored scale is ``scale_inv * 2^8`` (w_elem.h: the exponent-bias
difference of e4m3 and float16, folded in).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from llm_svc.kernels.ckernels import CKernel
from . import cpu_packed
from .quant import MXFP4_GROUP, fp8_scale_rows

FP8_GROUP = 128
_FP8_BIAS = 2.0 ** 8


@dataclass(frozen=True)
class PackedWeight:
    """One linear's weight ``[n, k]`` packed for ``kernel`` (its format ``fmt``): ``data`` the tiles
    (uint8 bytes ``[ceil(n / 2VL), k, row bytes]``, or float32 ``[.., k, 2VL]``), ``scales`` the
    per-(column, K group) scales (FP8 float32 ``[.., ceil(k / 128), 2VL]``, MXFP4 E8M0 bytes
    ``[.., k / 32, 2VL]``) or None. Stacked experts carry a leading ``[E]``."""

    fmt: str
    n: int
    k: int
    data: torch.Tensor
    scales: torch.Tensor | None
    kernel: CKernel

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + (
            0 if self.scales is None else self.scales.numel() * self.scales.element_size())


@dataclass(frozen=True)
class PackedExperts:
    """Every expert's SiLU-gated MLP packed for ``cpu_packed.moe_w``: ``gate_up`` (n = 2I, k = H;
    tile j: gate columns ``j VL ..`` then up columns ``j VL ..``) and ``down`` (n = H, k = I)."""

    fmt: str
    num_experts: int
    hidden: int
    inter: int
    gate_up: PackedWeight
    down: PackedWeight
    kernel: CKernel

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes


def kernel(fmt: str, kernels: dict[str, CKernel] | None = None) -> CKernel | None:
    """The built kernel of ``fmt`` (of ``kernels``, default ``cpu_packed.KERNELS``), or None."""
    k = (kernels or cpu_packed.KERNELS).get(fmt)
    return k if k is not None and k.available() else None


def _vl(k: CKernel) -> int:
    return int(k.load().mmserve_packed_vl())


def _tiles(t: torch.Tensor, nb: int) -> torch.Tensor:
    """``t [N, K, ...]`` -> ``[ceil(N / nb), K, nb, ...]`` (tile j: rows ``j nb ..``; missing rows 0)."""
    n, k = t.shape[:2]
    full, tail = divmod(n, nb)
    out = torch.empty(full + (1 if tail else 0), k, nb, *t.shape[2:], dtype=t.dtype)
    if full:
        out[:full].copy_(t[:full * nb].view(full, nb, k, *t.shape[2:]).transpose(1, 2))
    if tail:
        out[full].zero_()
        out[full, :, :tail].copy_(t[full * nb:].transpose(0, 1))
    return out


def fp8_packable(block: tuple[int, int]) -> bool:
    """Whether FP8 weights with ``block`` scale blocks pack (128-deep K blocks: the kernel's group)."""
    return block[1] == FP8_GROUP


def pack(fmt: str, w: torch.Tensor, scale: torch.Tensor | None = None, *, block: tuple[int, int] = (128, 128),
         row_groups: int = 1, rows: torch.Tensor | None = None,
         kernels: dict[str, CKernel] | None = None) -> PackedWeight:
    """One stored weight packed for ``fmt``'s kernel (which must build: ``kernel(fmt)``):

    * ``"float32"`` / ``"bfloat16"``: ``w [N, K]`` of that dtype;
    * ``"fp8"``: ``w`` float8_e4m3fn ``[N, K]``, ``scale`` its ``weight_scale_inv`` grid (``block``,
      ``row_groups`` as ``quant.dequant_fp8_block``);
    * ``"mxfp4"``: ``w`` the uint8 blocks ``[N, K / 32, 16]``, ``scale`` the E8M0 scales ``[N, K / 32]``.

    ``rows`` (int64 ``[N]``): the packed weight's row i is the stored row ``rows[i]``."""
    kern = kernel(fmt, kernels)
    if kern is None:
        raise RuntimeError(f"the packed kernel for {fmt} weights does not build here")
    nb = 2 * _vl(kern)
    take = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
    scales = None
    if fmt == "float32" or fmt == "bfloat16":
        want = torch.float32 if fmt == "float32" else torch.bfloat16
        if w.dtype != want or w.dim() != 2:
            raise ValueError(f"{fmt} packing takes a 2-D {want} weight, got {w.dtype} {list(w.shape)}")
        n, k = w.shape
        data = _tiles(take(w.detach()), nb)
        if fmt == "bfloat16":
            data = data.view(torch.int16).view(torch.uint8).view(data.shape[0], k, 2 * nb)
    elif fmt == "fp8":
        if w.dtype != torch.float8_e4m3fn or w.dim() != 2 or scale is None:
            raise ValueError(f"fp8 packing takes a 2-D float8_e4m3fn weight and its scale, got {w.dtype}")
        if not fp8_packable(block):
            raise ValueError(f"fp8 blocks {list(block)}: the kernel packs 128-deep K blocks only")
        n, k = w.shape
        srow = fp8_scale_rows(n, k, scale.shape, block, row_groups)  # [N]
        data = _tiles(take(w.view(torch.uint8)), nb)  # [nb, K, NB] bytes
        s = take(scale.float().index_select(0, srow)) * _FP8_BIAS  # [N, ceil(K / 128)]
        if not torch.isfinite(s).all():
            raise ValueError("fp8 scales of 2^120 or more do not pack (scale x 2^8 overflows float32)")
        scales = _tiles(s, nb)  # [nb, ceil(K / 128), NB]
    elif fmt == "mxfp4":
        if w.dtype != torch.uint8 or scale is None or w.dim() != 3 or w.shape[2] != MXFP4_GROUP // 2 \
                or tuple(scale.shape) != tuple(w.shape[:2]):
            raise ValueError(f"mxfp4 packing takes blocks [N, G, 16] and scales [N, G], got {list(w.shape)}")
        n, g = w.shape[:2]
        k = g * MXFP4_GROUP
        b = take(w)
        nib = torch.stack((b & 0x0F, b >> 4), dim=-1).view(n, k)  # [N, K]: element 2i in the low nibble
        t = _tiles(nib, nb)  # [nb, K, NB], one nibble a byte
        data = t[..., :nb // 2] | (t[..., nb // 2:] << 4)  # [nb, K, VL]: column i low, VL + i high
        scales = _tiles(take(scale), nb)  # [nb, G, NB]
    else:
        raise ValueError(f"weight format must be one of {sorted(cpu_packed.FORMATS)}, got {fmt!r}")
    return PackedWeight(fmt, n, k, data.contiguous(), None if scales is None else scales.contiguous(), kern)


def experts_packable(fmt: str, hidden: int, inter: int, kernels: dict[str, CKernel] | None = None) -> bool:
    """Whether ``pack_experts`` takes experts of this shape for ``fmt`` here (I a multiple of the
    kernel's vector width, H of twice it; MXFP4: H and I multiples of 32 too)."""
    kern = kernel(fmt, kernels)
    if kern is None:
        return False
    vl = _vl(kern)
    ok = inter % vl == 0 and hidden % (2 * vl) == 0
    return ok and (fmt != "mxfp4" or (hidden % MXFP4_GROUP == 0 and inter % MXFP4_GROUP == 0))


Stored = Callable[[int], dict]  # expert e -> pack()'s keyword arguments: w, scale, block, row_groups


def pack_experts(fmt: str, num_experts: int, gate_up: Stored, down: Stored,
                 kernels: dict[str, CKernel] | None = None) -> PackedExperts:
    """Every expert packed into one stacked copy, one expert at a time: ``gate_up(e)`` gives
    ``pack``'s arguments for expert e's ``[2I, H]`` weight (gate rows, then up rows; FP8 scale
    grids stacked the same way, ``row_groups=2`` where I is not a multiple of the block),
    ``down(e)`` for its ``[H, I]`` one. Check ``experts_packable`` first."""
    kern = kernel(fmt, kernels)
    vl = _vl(kern)
    stacked: dict[str, PackedWeight] = {}
    for e in range(num_experts):
        for name, get in (("gate_up", gate_up), ("down", down)):
            args = get(e)
            if name == "gate_up":
                n = args["w"].shape[0]
                j = torch.arange(n // 2).view(-1, vl)  # [I / VL, VL]
                args["rows"] = torch.cat((j, j + n // 2), 1).reshape(-1)  # tile j: gate j VL.., then up j VL..
            p = pack(fmt, kernels=kernels, **args)
            if e == 0:
                stacked[name] = PackedWeight(
                    fmt, p.n, p.k, torch.empty(num_experts, *p.data.shape, dtype=p.data.dtype),
                    None if p.scales is None else torch.empty(num_experts, *p.scales.shape, dtype=p.scales.dtype),
                    kern)
            s = stacked[name]
            s.data[e].copy_(p.data)
            if s.scales is not None:
                s.scales[e].copy_(p.scales)
    g, d = stacked["gate_up"], stacked["down"]
    if g.n != 2 * d.k or d.n != g.k:
        raise ValueError(f"experts: gate_up [{g.n}, {g.k}] and down [{d.n}, {d.k}] do not make an MLP")
    return PackedExperts(fmt, num_experts, g.k, d.k, g, d, kern)
