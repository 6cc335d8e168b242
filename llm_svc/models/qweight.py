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
from .quant import FP4_VALUES, MXFP4_GROUP, fp8_scale_rows

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


# A weight "by rows": ``rows [N, K]`` one element a row entry (float32, bfloat16 as int16, e4m3
# bytes, MXFP4 one nibble a byte) and ``rscales [N, groups]`` (FP8 float32 x 2^8, MXFP4 E8M0
# bytes; None unscaled): what tiles are made of, and what they are unmade into to join weights.

def _from_rows(fmt: str, rows: torch.Tensor, rscales: torch.Tensor | None, kern: CKernel) -> PackedWeight:
    nb = 2 * _vl(kern)
    n, k = rows.shape
    data = _tiles(rows, nb)  # [nb, K, NB]
    if fmt == "bfloat16":
        data = data.view(torch.uint8).view(data.shape[0], k, 2 * nb)
    elif fmt == "mxfp4":
        data = data[..., :nb // 2] | (data[..., nb // 2:] << 4)  # [nb, K, VL]: column i low, VL + i high
    scales = None if rscales is None else _tiles(rscales, nb).contiguous()
    return PackedWeight(fmt, n, k, data.contiguous(), scales, kern)


def _untile(t: torch.Tensor, n: int) -> torch.Tensor:
    """``_tiles``' inverse: ``[nb, K, NB, ...]`` -> ``[n, K, ...]``."""
    nb, k, cols = t.shape[:3]
    return t.transpose(1, 2).reshape(nb * cols, k, *t.shape[3:])[:n]


def _to_rows(pw: PackedWeight) -> tuple[torch.Tensor, torch.Tensor | None]:
    d = pw.data
    if pw.fmt == "bfloat16":
        d = d.view(torch.int16)
    elif pw.fmt == "mxfp4":
        d = torch.cat((d & 0x0F, d >> 4), -1)  # [nb, K, NB], one nibble a byte
    return _untile(d, pw.n), None if pw.scales is None else _untile(pw.scales, pw.n)


def dense(pw: PackedWeight) -> torch.Tensor:
    """The float32 weight ``[n, k]`` a packed one stands for (the dequantized checkpoint tensor)."""
    rows, rs = _to_rows(pw)
    if pw.fmt == "float32":
        return rows.clone()
    if pw.fmt == "bfloat16":
        return rows.view(torch.bfloat16).float()
    if pw.fmt == "fp8":
        s = rs / _FP8_BIAS
        return rows.view(torch.float8_e4m3fn).float() * s[:, torch.arange(pw.k) // FP8_GROUP]
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    return lut[rows.long()] * torch.exp2(rs.float() - 127.0)[:, torch.arange(pw.k) // MXFP4_GROUP]


def concat(parts: list[PackedWeight], rows: torch.Tensor | None = None) -> PackedWeight:
    """Packed weights of one format and input size joined by rows (``[sum of n, k]``, then the
    rows ``rows`` of that if given): q | k | v, or a gated MLP's gate | up."""
    if len({(p.fmt, p.k) for p in parts}) != 1:
        raise ValueError("joined packed weights need one format and one input size")
    pieces = [_to_rows(p) for p in parts]
    r = torch.cat([x for x, _ in pieces])
    s = None if pieces[0][1] is None else torch.cat([x for _, x in pieces])
    if rows is not None:
        r, s = r.index_select(0, rows), None if s is None else s.index_select(0, rows)
    return _from_rows(parts[0].fmt, r, s, parts[0].kernel)


def pack(fmt: str, w: torch.Tensor, scale: torch.Tensor | None = None, *, block: tuple[int, int] = (128, 128),
         row_groups: int = 1, rows: torch.Tensor | None = None, cols: tuple[int, int] | None = None,
         kernels: dict[str, CKernel] | None = None) -> PackedWeight:
    """One stored weight packed for ``fmt``'s kernel (which must build: ``kernel(fmt)``):

    * ``"float32"`` / ``"bfloat16"``: ``w [N, K]`` of that dtype;
    * ``"fp8"``: ``w`` float8_e4m3fn ``[N, K]``, ``scale`` its ``weight_scale_inv`` grid (``block``,
      ``row_groups`` as ``quant.dequant_fp8_block``);
    * ``"mxfp4"``: ``w`` the uint8 blocks ``[N, K / 32, 16]``, ``scale`` the E8M0 scales ``[N, K / 32]``.

    ``rows`` (int64): the packed weight's row i is the stored row ``rows[i]`` (a fused
    projection's part, or its rows in another order). ``cols``: only stored columns ``[c0, c1)``
    (a tensor-parallel rank's share of the input); scaled formats split on their block edges."""
    kern = kernel(fmt, kernels)
    if kern is None:
        raise RuntimeError(f"the packed kernel for {fmt} weights does not build here")
    take = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
    if rows is not None and rows.numel() > 1 and bool((rows[1:] - rows[:-1] == 1).all()):
        r0, nr = int(rows[0]), rows.numel()  # a run of rows (a rank's share, a fused part): a view, no gather
        take = lambda t: t.narrow(0, r0, nr)  # noqa: E731
    rscales = None
    if fmt == "float32" or fmt == "bfloat16":
        want = torch.float32 if fmt == "float32" else torch.bfloat16
        if w.dtype != want or w.dim() != 2:
            raise ValueError(f"{fmt} packing takes a 2-D {want} weight, got {w.dtype} {list(w.shape)}")
        r = take(w.detach())
        r = r.view(torch.int16) if fmt == "bfloat16" else r
    elif fmt == "fp8":
        if w.dtype != torch.float8_e4m3fn or w.dim() != 2 or scale is None:
            raise ValueError(f"fp8 packing takes a 2-D float8_e4m3fn weight and its scale, got {w.dtype}")
        if not fp8_packable(block):
            raise ValueError(f"fp8 blocks {list(block)}: the kernel packs 128-deep K blocks only")
        n, k = w.shape
        srow = fp8_scale_rows(n, k, scale.shape, block, row_groups)  # [N]
        r = take(w.view(torch.uint8))
        rscales = take(scale.float().index_select(0, srow)) * _FP8_BIAS  # [N, ceil(K / 128)]
        if not torch.isfinite(rscales).all():
            raise ValueError("fp8 scales of 2^120 or more do not pack (scale x 2^8 overflows float32)")
    elif fmt == "mxfp4":
        if w.dtype != torch.uint8 or scale is None or w.dim() != 3 or w.shape[2] != MXFP4_GROUP // 2 \
                or tuple(scale.shape) != tuple(w.shape[:2]):
            raise ValueError(f"mxfp4 packing takes blocks [N, G, 16] and scales [N, G], got {list(w.shape)}")
        b = take(w)
        r = torch.stack((b & 0x0F, b >> 4), dim=-1).view(b.shape[0], -1)  # [N, K]: element 2i in the low nibble
        rscales = take(scale)
    else:
        raise ValueError(f"weight format must be one of {sorted(cpu_packed.FORMATS)}, got {fmt!r}")
    if cols is not None:
        r, rscales = _take_cols(fmt, r, rscales, cols)
    return _from_rows(fmt, r, rscales, kern)


def _take_cols(fmt: str, r: torch.Tensor, rscales: torch.Tensor | None,
               cols: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Columns ``[c0, c1)`` of rows ``r [N, K]`` and of their scales (one per ``FP8_GROUP`` /
    ``MXFP4_GROUP`` columns), which must begin on a block edge and end on one or at K."""
    c0, c1 = cols
    k = r.shape[1]
    if not 0 <= c0 < c1 <= k:
        raise ValueError(f"columns [{c0}, {c1}) are not inside the weight's {k}")
    r = r[:, c0:c1].contiguous()
    if rscales is None:
        return r, None
    g = FP8_GROUP if fmt == "fp8" else MXFP4_GROUP
    if c0 % g or (c1 % g and c1 != k):
        raise ValueError(f"a {fmt} weight splits on its {g}-column scale blocks; columns [{c0}, {c1}) do not")
    return r, rscales[:, c0 // g:-(-c1 // g)].contiguous()


def experts_packable(fmt: str, hidden: int, inter: int, kernels: dict[str, CKernel] | None = None) -> bool:
    """Whether ``pack_experts`` takes experts of this shape for ``fmt`` here (I a multiple of the
    kernel's vector width, H of twice it; MXFP4: H and I multiples of 32 too)."""
    kern = kernel(fmt, kernels)
    if kern is None:
        return False
    vl = _vl(kern)
    ok = inter % vl == 0 and hidden % (2 * vl) == 0
    return ok and (fmt != "mxfp4" or (hidden % MXFP4_GROUP == 0 and inter % MXFP4_GROUP == 0))


def pack_experts(num_experts: int, gate_up: Callable[[int], PackedWeight],
                 down: Callable[[int], PackedWeight]) -> PackedExperts:
    """Every expert's packed weights joined into one stacked copy, one expert at a time:
    ``gate_up(e)`` expert e's ``[2I, H]`` (gate rows, then up rows; e.g. ``concat`` of its two
    projections, or ``pack`` of a stored stacked tensor), ``down(e)`` its ``[H, I]``. The
    callables may free what they read as they go. Check ``experts_packable`` first."""
    stacked: dict[str, PackedWeight] = {}
    for e in range(num_experts):
        for name, get in (("gate_up", gate_up), ("down", down)):
            p = get(e)
            if name == "gate_up":  # tile j: gate columns j VL .., then up columns j VL ..
                vl = _vl(p.kernel)
                j = torch.arange(p.n // 2).view(-1, vl)  # [I / VL, VL]
                p = concat([p], torch.cat((j, j + p.n // 2), 1).reshape(-1))
            if e == 0:
                stacked[name] = PackedWeight(
                    p.fmt, p.n, p.k, torch.empty(num_experts, *p.data.shape, dtype=p.data.dtype),
                    None if p.scales is None else torch.empty(num_experts, *p.scales.shape, dtype=p.scales.dtype),
                    p.kernel)
            s = stacked[name]
            if (p.fmt, p.n, p.k) != (s.fmt, s.n, s.k):
                raise ValueError(f"expert {e}: {name} is {p.fmt} [{p.n}, {p.k}], expert 0's {s.fmt} [{s.n}, {s.k}]")
            s.data[e].copy_(p.data)
            if s.scales is not None:
                s.scales[e].copy_(p.scales)
    g, d = stacked["gate_up"], stacked["down"]
    if g.n != 2 * d.k or d.n != g.k:
        raise ValueError(f"experts: gate_up [{g.n}, {g.k}] and down [{d.n}, {d.k}] do not make an MLP")
    return PackedExperts(g.fmt, num_experts, g.k, d.k, g, d, g.kernel)


def dense_of(m) -> torch.Tensor | None:
    """The float32 weight of a linear kept packed at load, wherever its packed copy lives now:
    its own ``qweight``, its rows of a joined weight (``linear.join_packed``), or its part of a
    layer's stacked experts (``fused_mlp.RoutedExperts``); None for a float linear."""
    if getattr(m, "qweight", None) is not None:
        return dense(m.qweight)
    if getattr(m, "qweight_joined", None) is not None:
        r0, r1 = m.qweight_rows
        return dense(m.qweight_joined)[r0:r1]
    src = getattr(m, "qweight_expert", None)
    if src is None:
        return None
    pe, e, part = src
    p = pe.down if part == "down" else pe.gate_up
    w = dense(PackedWeight(p.fmt, p.n, p.k, p.data[e], None if p.scales is None else p.scales[e], p.kernel))
    if part == "down":
        return w
    i, vl = pe.inter, _vl(pe.kernel)
    j = torch.arange(i).view(-1, vl)
    stored = torch.empty_like(w)
    stored[torch.cat((j, j + i), 1).reshape(-1)] = w  # the tiles' interleaved gate / up rows, back in order
    return stored[:i] if part == "gate" else stored[i:]


def state_dict_hook(module, state_dict: dict, prefix: str, local_metadata) -> None:
    """``state_dict`` of a linear kept packed: its dequantized weight (in ``module.qweight_dtype``)
    under ``weight``, so a packed model's state dict is the dequantized model's (materialized
    per call: a serving model never asks for it)."""
    w = dense_of(module)
    if w is not None:
        state_dict[prefix + "weight"] = w.to(getattr(module, "qweight_dtype", torch.float32))
