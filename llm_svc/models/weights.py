"""Strict safetensors loading: every tensor the module expects, with its exact shape, and no
tensor the config does not explain. Errors name the file and the tensor."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from shared.bundle import CheckpointError

from .quant import QuantScheme

INDEX = "model.safetensors.index.json"


def tensor_files(model_dir: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (``model.safetensors`` or the index's shards)."""
    from safetensors import safe_open

    root = Path(model_dir)
    if (root / INDEX).exists():
        try:
            weight_map = json.loads((root / INDEX).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{root / INDEX}: not a safetensors index ({e})") from e
        out = {name: root / f for name, f in weight_map.items()}
        for f in sorted(set(out.values())):
            if not f.exists():
                raise CheckpointError(f"{root / INDEX}: shard {f.name} is missing")
        return out
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root}: no model.safetensors (or {INDEX}) in the checkpoint")
    out = {}
    for f in files:
        with safe_open(str(f), "pt") as h:
            for name in h.keys():
                out[name] = f
    return out


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
              "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class _SafetensorsFile:
    """A safetensors file read one tensor at a time with ``pread`` into a tensor of its own.
    Not through a mapping (``safe_open``): the pages of a mapping that a load touches count in
    the process's resident memory until the file is closed, so a load held the checkpoint
    twice at its peak (the file's pages and the packed copies: 2.0x the packed model on a
    200 MB FP8 MiMo; read this way, the page cache holds them and the kernel may drop them).
    Dtypes it does not know are read through ``safe_open``."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            self.header = json.loads(f.read(n))
        self.start = 8 + n
        self._st = None

    def meta(self, name: str) -> torch.Tensor:
        """``name``'s shape and dtype as a meta tensor (nothing read); an unknown dtype reads as uint8."""
        m = self.header[name]
        return torch.empty(m["shape"], dtype=_ST_DTYPES.get(m["dtype"], torch.uint8), device="meta")

    def get_tensor(self, name: str, index: int | None = None) -> torch.Tensor:
        """The tensor ``name``, or only its ``index``-th entry along dimension 0 (an expert of a
        stacked tensor: only its bytes are read)."""
        meta = self.header[name]
        dtype = _ST_DTYPES.get(meta["dtype"])
        if dtype is None:
            from safetensors import safe_open

            if self._st is None:
                self._st = safe_open(str(self.path), "pt")
            return self._st.get_tensor(name) if index is None else self._st.get_slice(name)[index]
        b, e = meta["data_offsets"]
        shape = meta["shape"]
        if index is not None:
            if not 0 <= index < shape[0]:
                raise IndexError(f"{name}: entry {index} of {shape[0]}")
            row = (e - b) // shape[0]
            b, e, shape = b + index * row, b + (index + 1) * row, shape[1:]
        raw = torch.empty(e - b, dtype=torch.uint8)
        with open(self.path, "rb", buffering=0) as f:
            got, view = 0, memoryview(raw.numpy())
            while got < e - b:
                k = os.preadv(f.fileno(), [view[got:]], self.start + b + got)
                if k <= 0:
                    raise CheckpointError(f"{self.path}: tensor {name!r} is cut short")
                got += k
        return raw.view(dtype).view(shape)


class CheckpointTensors:
    """The model tensors of a checkpoint directory: stored tensors grouped and dequantized by the
    ``scheme`` (None: every tensor as stored). Names are the file's (companions folded in)."""

    def __init__(self, model_dir: str | Path, scheme: QuantScheme | None = None):
        self.files = tensor_files(model_dir)
        self.scheme = scheme
        self._open: dict[Path, object] = {}
        present = set(self.files)
        if scheme is not None:
            scheme.check_companions(present, self.where)
        self.groups: dict[str, dict[str, str]] = {}
        for name in sorted(present):
            logical = scheme.logical(name) if scheme is not None else name
            if logical is not None:
                self.groups[logical] = scheme.companions(logical, present) if scheme is not None else {"value": name}

    def where(self, name: str) -> Path:
        return self.files.get(name, next(iter(self.files.values()), Path(".")))

    def _file(self, name: str) -> _SafetensorsFile:
        if name not in self.files:
            raise CheckpointError(f"{self.where(name)}: tensor {name!r} is missing from the checkpoint")
        f = self.files[name]
        if f not in self._open:
            self._open[f] = _SafetensorsFile(f)
        return self._open[f]

    def read(self, name: str, index: int | None = None) -> torch.Tensor:
        """One stored tensor (or its ``index``-th entry along dimension 0), read into memory of its
        own (``_SafetensorsFile``)."""
        return self._file(name).get_tensor(name, index)

    def meta(self, name: str) -> torch.Tensor:
        """A stored tensor's shape and dtype (a meta tensor: nothing is read)."""
        return self._file(name).meta(name)

    def get(self, logical: str, row_groups: int = 1) -> tuple[torch.Tensor, bool]:
        """The float tensor of ``logical`` and whether it was stored quantized."""
        group = self.groups[logical]
        if self.scheme is None:
            return self.read(group["value"]), False
        return self.scheme.dequantize(logical, group, self.read, self.where(next(iter(group.values()))), row_groups)


# (target module name, the file tensor as read, it was stored quantized) -> (module name, tensor) pairs
Convert = Callable[[str, torch.Tensor, bool], list[tuple[str, torch.Tensor]]]


# (the checkpoint's tensors, a stored tensor's name, its module name) -> the module tensors filled, or None
Pack = Callable[["CheckpointTensors", str, str], "list[str] | None"]


def fp8_packs_here(scheme: QuantScheme | None, device: str | torch.device = "cpu") -> bool:
    """Whether ``load_strict(keep_packed=True)`` keeps this checkpoint's FP8 linears packed: a
    block-FP8 scheme with 128-deep K blocks, a CPU model, and the kernel's FP8 build built here."""
    from . import qweight

    return (scheme is not None and scheme.method == "fp8" and torch.device(device).type == "cpu"
            and qweight.fp8_packable(scheme.block) and qweight.kernel("fp8") is not None)


def _assign(module: torch.nn.Module, name: str, t: torch.Tensor) -> None:
    """Set the parameter or buffer ``name`` of ``module`` to ``t`` (a meta placeholder's real tensor)."""
    owner, _, attr = name.rpartition(".")
    m = module.get_submodule(owner)
    if attr in m._parameters:
        m._parameters[attr] = torch.nn.Parameter(t, requires_grad=False)
    else:
        m._buffers[attr] = t


def _packed_linears(module, src, name: str, target: str, want: dict, convert, row_groups: int, shard=None):
    """The FP8 linear(s) a stored tensor becomes, packed from its e4m3 bytes and scales as read
    (``qweight.pack``; a fused projection's parts by their rows): ``[(module, name, PackedWeight)]``,
    or None where it is not a packable FP8 linear weight (the dequantize path then reads it and
    words any error)."""
    from torch import nn

    from . import qweight

    group = src.groups[name]
    if "scale" not in group:
        return None
    t = src.read(group["value"])
    if t.dtype != torch.float8_e4m3fn or t.dim() != 2:
        return None
    s = src.read(group["scale"])
    if not s.dtype.is_floating_point or s.element_size() < 2:
        return None
    idx = torch.arange(t.shape[0]).view(-1, 1)  # the pieces' rows, as convert splits them
    try:
        pieces = convert(target, idx, True) if convert is not None else [(target, idx)]
    except ValueError:
        return None
    out = []
    for tgt, rows in pieces:
        owner, _, attr = tgt.rpartition(".")
        mod = module.get_submodule(owner) if tgt in want else None
        cut = shard.slice(tgt) if shard is not None else None
        cols = (cut[1], cut[2]) if cut is not None and cut[0] == 1 else None
        if cut is not None and cut[0] == 0:
            rows = rows[cut[1]:cut[2]]
        k = cols[1] - cols[0] if cols is not None else t.shape[1]
        if attr != "weight" or type(mod) is not nn.Linear or tuple(want[tgt].shape) != (rows.shape[0], k):
            return None
        r = rows[:, 0]
        whole = r.numel() == t.shape[0] and bool((r == torch.arange(t.shape[0])).all())
        try:
            pw = qweight.pack("fp8", t, s, block=src.scheme.block, row_groups=row_groups, rows=None if whole else r,
                              cols=cols)
        except ValueError:
            return None
        out.append((mod, tgt, pw))
    return out


def widen_mixed_groups(module: torch.nn.Module, parts: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")) -> int:
    """Where some linears of one block (``parts`` of one module) were kept packed and others were
    not (a tensor-parallel column split off the FP8 scale blocks is read dequantized), widen the
    packed ones too: the block's fused paths take one form. Returns how many were widened."""
    from . import qweight

    n = 0
    for m in module.modules():
        lin = [getattr(m, p, None) for p in parts]
        if any(x is None for x in lin):
            continue
        packed = [getattr(x, "qweight", None) is not None for x in lin]
        if all(packed) or not any(packed):
            continue
        for x, was in zip(lin, packed):
            if was:
                x.weight = torch.nn.Parameter(qweight.dense(x.qweight).to(x.qweight_dtype), requires_grad=False)
                x.qweight = None
                del x.forward  # the instance's packed forward: nn.Linear's again
                n += 1
    return n


_TRIM_EVERY = 32 << 20  # bytes packed between two malloc_trim calls


def malloc_trim() -> None:
    """Give the C heap's free pages back (glibc; a no-op elsewhere). Packing frees a tensor's
    temporaries between long-lived packed copies, and glibc kept those holes resident: a
    200 MB FP8 MiMo peaked at 1.9x its packed size while loading, 1.0x trimmed every 32 MB."""
    global _libc
    if _libc is None:
        import ctypes

        try:
            _libc = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc(0)


_libc = None


def load_strict(module: torch.nn.Module, model_dir: str | Path, dtype: torch.dtype,
                rename: Callable[[str], str | None] = lambda n: n, derived: frozenset[str] = frozenset(),
                scheme: QuantScheme | None = None, convert: Convert | None = None,
                row_groups: Callable[[str], int] = lambda n: 1, keep_packed: bool = False, shard=None,
                pack: Pack | None = None) -> None:
    """Copy the checkpoint's tensors into ``module`` (its parameters and persistent buffers).

    ``rename`` maps a file's tensor name to the module's name, or None for a tensor to read past
    (MTP heads); ``derived`` names module tensors the file need not hold (a tied lm_head);
    ``scheme`` dequantizes a quantized checkpoint (``row_groups`` of a file tensor: its
    independently scaled row chunks); ``convert`` turns one stored tensor into module tensors
    (a fused projection split, a layout transpose). A missing tensor, a shape mismatch or a
    tensor nothing explains is a ``CheckpointError`` naming the file and the tensor.

    ``keep_packed`` (check ``fp8_packs_here``): each FP8 ``nn.Linear`` weight is packed straight
    from its stored bytes and scales, one tensor at a time, never widened: the module's
    ``weight`` becomes None and ``module.qweight`` the ``qweight.PackedWeight`` (``linear``
    serves it). The module may then be built on the meta device: every tensor read replaces its
    meta placeholder (so peak memory stays near the packed model's size).

    ``shard`` (a tensor-parallel rank's, e.g. ``mimo_tp.MiMoShard``): ``shard.slice(target)`` is
    ``(dim, start, stop)`` of each module tensor this rank holds part of (None: all of it); the
    module was built with the rank's shapes, and each tensor is cut as it is read, one at a time,
    so a rank's peak memory stays near its share.

    ``pack(src, name, target)``: a model's own packing of a stored tensor (gpt-oss' MXFP4
    experts: ``gpt_oss_moe``), given first refusal on every tensor: the module tensors it filled,
    or None for the paths above to read it."""
    src = CheckpointTensors(model_dir, scheme)
    want = dict(module.state_dict())
    seen: set[str] = set()
    todo: list[tuple[str, str]] = []
    for name in src.groups:
        target = rename(name)
        if target is None:
            continue
        if convert is None and target not in want:
            raise CheckpointError(f"{src.where(name)}: tensor {name!r} is not part of the model the config "
                                  "describes (a config field disagrees with the weights)")
        todo.append((name, target))
    keep_packed = keep_packed and fp8_packs_here(scheme)
    from . import qweight
    from .linear import OwnPacked
    since_trim = 0
    with torch.no_grad():
        for name, target in todo:
            filled = pack(src, name, target) if pack is not None else None
            if filled:
                seen.update(filled)
                continue
            packed = _packed_linears(module, src, name, target, want, convert, row_groups(name), shard) \
                if keep_packed else None
            if packed:
                for mod, tgt, pw in packed:
                    mod.weight = None
                    mod.qweight = pw
                    mod.qweight_dtype = dtype
                    mod._register_state_dict_hook(qweight.state_dict_hook)  # state_dict: the dequantized weight
                    mod.forward = OwnPacked(mod)  # the module stays callable
                    seen.add(tgt)
                    since_trim += pw.nbytes
                if since_trim >= _TRIM_EVERY:
                    malloc_trim()
                    since_trim = 0
                continue
            t, quantized = src.get(name, row_groups(name))
            f = src.where(name if name in src.files else next(iter(src.groups[name].values())))
            try:
                pieces = convert(target, t, quantized) if convert is not None else [(target, t)]
            except ValueError as e:
                raise CheckpointError(f"{f}: tensor {name!r}: {e}") from e
            for tgt, piece in pieces:
                cut = shard.slice(tgt) if shard is not None else None
                if cut is not None:
                    dim, a, b = cut
                    if piece.dim() <= dim or piece.shape[dim] < b:
                        raise CheckpointError(f"{f}: tensor {name!r} has shape {list(piece.shape)}, too small for "
                                              f"this rank's part [{a}, {b}) of dimension {dim}")
                    piece = piece.narrow(dim, a, b - a).clone()  # its own storage: the whole tensor is freed
                if tgt not in want:
                    raise CheckpointError(f"{f}: tensor {name!r} is not part of the model the config describes "
                                          "(a config field disagrees with the weights)")
                dst = want[tgt]
                if tuple(piece.shape) != tuple(dst.shape):
                    shown = name if tgt == target else f"{name} -> {tgt}"
                    raise CheckpointError(f"{f}: tensor {shown!r} has shape {list(piece.shape)}, the config "
                                          f"implies {list(dst.shape)}")
                if dst.is_meta:  # built on the meta device: this tensor becomes the module's
                    real = piece.to(dtype)
                    _assign(module, tgt, real if real.is_contiguous() else real.contiguous())
                else:
                    dst.copy_(piece.to(dst.dtype))
                seen.add(tgt)
    if keep_packed:
        malloc_trim()
    missing = sorted(set(want) - seen - derived)
    if missing:
        root = Path(model_dir)
        where = root / INDEX if (root / INDEX).exists() else sorted(set(src.files.values()))[0]
        raise CheckpointError(f"{where}: tensor {missing[0]!r} is missing from the checkpoint "
                              f"({len(missing)} missing in all)")
    module.to(dtype)
