"""Load-time dequantization of published quantized checkpoints, by ``quantization_config.quant_method``.

mmserve computes in the serving dtype, so a quantized checkpoint is dequantized once, while its
tensors are read (what vLLM does on hardware without FP8 / MXFP4 kernels). Two published forms:

* ``fp8`` (block-wise, DeepSeek-V3 style; XiaomiMiMo/MiMo-V2-Flash, MiMo-V2.5):
  ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
  "weight_block_size": [128, 128]}``. A quantized linear ``X.weight`` is ``float8_e4m3fn``
  ``[out, in]`` with a sibling ``X.weight_scale_inv`` ``[ceil(out/Bo), ceil(in/Bi)]`` (float32);
  value = e4m3 x the scale of its block (the "inv" scale multiplies: vLLM ``fp8.py``,
  transformers ``finegrained_fp8.Fp8Dequantize``). Which tensors are quantized is read from the
  dtypes (``ignored_layers`` / ``modules_to_not_convert`` only tell the same thing). A tensor may
  be stored as ``row_groups`` independent row chunks, each with its own scale rows (MiMo's fused
  ``qkv_proj``: vLLM ``mimo_v2.py`` ``_shard_fp8_qkv_proj``), or as one continuous grid.
* ``mxfp4`` (openai/gpt-oss-*): ``quantization_config = {"quant_method": "mxfp4",
  "modules_to_not_convert": [...]}``. A quantized tensor ``X`` is ``X_blocks`` uint8
  ``[..., N, G, 16]`` (two E2M1 nibbles per byte, element ``2i`` in the low nibble) and
  ``X_scales`` uint8 ``[..., N, G]`` (E8M0: scale ``2**(byte - 127)``), 32 elements per group;
  dequantized it is ``[..., N, G*32]`` (transformers ``integrations/mxfp4.py``
  ``convert_moe_packed_tensors`` before its final transpose, which the model's loader applies).

Unknown methods and parameters are a ``CheckpointError`` naming the file and the field.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from shared.bundle import CheckpointError
from shared.registry import Registry

Read = Callable[[str], torch.Tensor]  # file tensor name -> the tensor as stored


class QuantScheme(ABC):
    """How one ``quant_method`` stores tensors: which file tensors are companions (scales) of
    another, and how a stored group becomes one float tensor. A scheme registers itself in
    ``QUANT_SCHEMES`` under its ``method``."""

    method: ClassVar[str]
    path: Path  # the config file (named in errors)

    @abstractmethod
    def logical(self, name: str) -> str | None:
        """The model tensor a file tensor ``name`` stands for; None for a companion (read with it)."""

    @abstractmethod
    def companions(self, logical: str, present: set[str]) -> dict[str, str]:
        """role -> file tensor name of the stored group of ``logical`` (of the names ``present``)."""

    @abstractmethod
    def dequantize(self, logical: str, group: dict[str, str], read: Read, where: Path,
                   row_groups: int = 1) -> tuple[torch.Tensor, bool]:
        """The float tensor of ``logical`` (float32 where it was quantized), and whether it was."""

    def check_companions(self, names: set[str], where: Callable[[str], Path]) -> None:
        """Every companion in the checkpoint belongs to a tensor that is there too (``where``: its file)."""
        for n in sorted(names):
            if self.logical(n) is None and not self._owner_present(n, names):
                raise CheckpointError(f"{where(n)}: tensor {n!r} is a {self.method} scale without its quantized tensor")

    @abstractmethod
    def _owner_present(self, companion: str, names: set[str]) -> bool: ...

    @classmethod
    @abstractmethod
    def from_config(cls, q: dict, path: Path) -> QuantScheme:
        """The scheme of the ``quantization_config`` dict ``q`` read from ``path``."""


QUANT_SCHEMES: Registry[type[QuantScheme]] = Registry("quant method")


def _fail(path: Path, key: str, why: str) -> CheckpointError:
    return CheckpointError(f"{path}: field 'quantization_config.{key}' {why}")


def _known(q: dict, allowed: set[str], path: Path) -> None:
    extra = sorted(set(q) - allowed)
    if extra:
        raise _fail(path, extra[0], f"is not understood by mmserve's {q.get('quant_method')} loader "
                                    f"(all unknown: {extra}; understood: {sorted(allowed)})")


def scheme_for(q: dict | None, path: str | Path = "config.json",
               allowed: tuple[str, ...] | None = None) -> QuantScheme | None:
    """The scheme of a ``quantization_config`` dict (None: not quantized); ``allowed`` limits the
    methods a model family accepts."""
    path = Path(path)
    if not q:
        return None
    if not isinstance(q, dict):
        raise CheckpointError(f"{path}: field 'quantization_config' must be an object, got {q!r}")
    method = q.get("quant_method")
    ok = QUANT_SCHEMES.names() if allowed is None else [m for m in allowed if m in QUANT_SCHEMES]
    if method not in ok:
        raise _fail(path, "quant_method", f"= {method!r} is not supported for this model (supported: {ok})")
    return QUANT_SCHEMES.get(method).from_config(q, path)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fp8_scale_rows(rows: int, cols: int, scale_shape, block: tuple[int, int], row_groups: int = 1,
                   what: str = "tensor") -> torch.Tensor:
    """The scale row of each of a ``[rows, cols]`` block-scaled weight's rows (int64 ``[rows]``):
    ``scale_shape`` is one grid ``[ceil(R/Bo), ceil(C/Bi)]`` or ``row_groups`` grids stacked, one
    per chunk of ``R/row_groups`` rows (``[row_groups * ceil(R/(row_groups*Bo)), ceil(C/Bi)]``);
    raises ValueError otherwise."""
    bo, bi = block
    if rows % row_groups:
        raise ValueError(f"{what}: {rows} rows do not split into {row_groups} chunks")
    chunk = rows // row_groups
    per_chunk = (row_groups * _cdiv(chunk, bo), _cdiv(cols, bi))
    continuous = (_cdiv(rows, bo), _cdiv(cols, bi))
    r = torch.arange(rows)
    if tuple(scale_shape) == per_chunk:
        return (r // chunk) * _cdiv(chunk, bo) + (r % chunk) // bo  # each chunk has its own scale rows
    if tuple(scale_shape) == continuous:
        return r // bo
    want = f"{list(continuous)}" + (f" or {list(per_chunk)} ({row_groups} chunks)" if row_groups > 1 else "")
    raise ValueError(f"{what}: scale has shape {list(scale_shape)}, weight {[rows, cols]} with blocks "
                     f"{list(block)} needs {want}")


def dequant_fp8_block(w: torch.Tensor, s: torch.Tensor, block: tuple[int, int], row_groups: int = 1,
                      what: str = "tensor") -> torch.Tensor:
    """``w`` e4m3 ``[R, C]`` x block scales ``s`` -> float32 ``[R, C]``. ``s`` is one grid
    ``[ceil(R/Bo), ceil(C/Bi)]`` or ``row_groups`` grids stacked, one per chunk of ``R/row_groups``
    rows (``[row_groups * ceil(R/(row_groups*Bo)), ceil(C/Bi)]``); raises ValueError otherwise."""
    if w.dim() != 2 or s.dim() != 2:
        raise ValueError(f"{what}: fp8 weight and scale must be 2-D, got {list(w.shape)} and {list(s.shape)}")
    rows, cols = w.shape
    srow = fp8_scale_rows(rows, cols, s.shape, block, row_groups, what)  # [R]
    scale = s.float()[srow][:, torch.arange(cols) // block[1]]  # [R, C]
    return w.float() * scale


@QUANT_SCHEMES.register("fp8")
@dataclass(frozen=True)
class Fp8Block(QuantScheme):
    """Block-wise e4m3 weights with float ``weight_scale_inv`` grids."""

    method: ClassVar[str] = "fp8"

    block: tuple[int, int]
    path: Path = field(default=Path("config.json"))
    SCALE: ClassVar[str] = "_scale_inv"

    @classmethod
    def from_config(cls, q: dict, path: Path) -> Fp8Block:
        _known(q, {"quant_method", "fmt", "activation_scheme", "weight_block_size", "ignored_layers",
                   "modules_to_not_convert"}, path)
        if q.get("fmt", "e4m3") != "e4m3":
            raise _fail(path, "fmt", f"= {q['fmt']!r} is not supported (supported: ['e4m3'])")
        if q.get("activation_scheme", "dynamic") != "dynamic":
            raise _fail(path, "activation_scheme", f"= {q['activation_scheme']!r} is not supported "
                                                   "(supported: ['dynamic']; static input scales are not read)")
        b = q.get("weight_block_size")
        if not (isinstance(b, list) and len(b) == 2 and all(isinstance(x, int) and not isinstance(x, bool) and x > 0
                                                            for x in b)):
            raise _fail(path, "weight_block_size", f"= {b!r} must be two positive ints (per-tensor fp8 is not "
                                                   "supported)")
        for key in ("ignored_layers", "modules_to_not_convert"):
            if q.get(key) is not None and not (isinstance(q[key], list) and all(isinstance(x, str) for x in q[key])):
                raise _fail(path, key, f"must be a list of module names, got {q[key]!r}")
        return cls(block=(b[0], b[1]), path=path)

    def logical(self, name: str) -> str | None:
        return None if name.endswith(".weight" + self.SCALE) else name

    def companions(self, logical: str, present: set[str]) -> dict[str, str]:
        scale = logical + self.SCALE
        return {"value": logical, **({"scale": scale} if logical.endswith(".weight") and scale in present else {})}

    def _owner_present(self, companion: str, names: set[str]) -> bool:
        return companion[: -len(self.SCALE)] in names

    def dequantize(self, logical, group, read, where, row_groups=1):
        t = read(group["value"])
        fp8 = t.dtype == torch.float8_e4m3fn
        if "scale" not in group:
            if fp8:
                raise CheckpointError(f"{where}: tensor {logical!r} is float8_e4m3fn but "
                                      f"{logical + self.SCALE!r} is missing")
            return t, False
        if not fp8:
            raise CheckpointError(f"{where}: tensor {logical!r} has a {self.SCALE[1:]} but is {t.dtype}, "
                                  "not float8_e4m3fn")
        s = read(group["scale"])
        if not s.dtype.is_floating_point or s.element_size() < 2:
            raise CheckpointError(f"{where}: tensor {group['scale']!r} must be a float32/bfloat16 scale, got {s.dtype}")
        try:
            return dequant_fp8_block(t, s, self.block, row_groups, repr(group["scale"])), True
        except ValueError as e:
            raise CheckpointError(f"{where}: {e}") from e


# E2M1 values by nibble (bit 3 = sign): transformers ``integrations/mxfp4.py`` FP4_VALUES
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32


def dequant_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, what: str = "tensor") -> torch.Tensor:
    """``blocks`` uint8 ``[..., N, G, 16]`` + E8M0 ``scales`` uint8 ``[..., N, G]`` -> float32
    ``[..., N, G*32]`` (element ``2i`` of a group in the low nibble of byte ``i``)."""
    check_mxfp4(blocks, scales, what)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    vals = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)  # [..., N, G, 16, 2]
    vals = vals.flatten(-2) * torch.exp2(scales.float() - 127.0)[..., None]  # [..., N, G, 32]
    return vals.flatten(-2)


def check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, what: str = "tensor") -> None:
    """Raise ValueError unless ``blocks`` / ``scales`` are uint8 ``[..., N, G, 16]`` / ``[..., N, G]``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{what}: blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != MXFP4_GROUP // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"{what}: blocks {list(blocks.shape)} and scales {list(scales.shape)} must be "
                         f"[..., N, G, {MXFP4_GROUP // 2}] and [..., N, G]")


@QUANT_SCHEMES.register("mxfp4")
@dataclass(frozen=True)
class Mxfp4(QuantScheme):
    """gpt-oss' MXFP4 experts: ``X_blocks`` + ``X_scales`` -> ``X``; other tensors as stored."""

    method: ClassVar[str] = "mxfp4"

    path: Path = field(default=Path("config.json"))

    @classmethod
    def from_config(cls, q: dict, path: Path) -> Mxfp4:
        _known(q, {"quant_method", "modules_to_not_convert"}, path)
        m = q.get("modules_to_not_convert")
        if m is not None and not (isinstance(m, list) and all(isinstance(x, str) for x in m)):
            raise _fail(path, "modules_to_not_convert", f"must be a list of module names, got {m!r}")
        return cls(path=path)

    def logical(self, name: str) -> str | None:
        if name.endswith("_scales"):
            return None
        return name[: -len("_blocks")] if name.endswith("_blocks") else name

    def companions(self, logical: str, present: set[str]) -> dict[str, str]:
        if logical + "_blocks" in present:
            return {"blocks": logical + "_blocks", "scales": logical + "_scales"}
        return {"value": logical}

    def _owner_present(self, companion: str, names: set[str]) -> bool:
        return companion[: -len("_scales")] + "_blocks" in names

    def dequantize(self, logical, group, read, where, row_groups=1):
        if "value" in group:
            return read(group["value"]), False
        try:
            return dequant_mxfp4(read(group["blocks"]), read(group["scales"]), repr(group["blocks"])), True
        except ValueError as e:
            raise CheckpointError(f"{where}: {e}") from e
