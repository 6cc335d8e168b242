"""Strict safetensors loading: every tensor the module expects, with its exact shape, and no
tensor the config does not explain. Errors name the file and the tensor."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from shared.bundle import CheckpointError

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


def load_strict(module: torch.nn.Module, model_dir: str | Path, dtype: torch.dtype,
                rename: Callable[[str], str | None] = lambda n: n, derived: frozenset[str] = frozenset()) -> None:
    """Copy the checkpoint's tensors into ``module`` (its parameters and persistent buffers).

    ``rename`` maps a file's tensor name to the module's name, or None for a tensor to read past
    (MTP heads); ``derived`` names module tensors the file need not hold (a tied lm_head). A missing tensor, a shape mismatch or a tensor nothing explains is a
    ``CheckpointError`` naming the file and the tensor."""
    from safetensors import safe_open

    files = tensor_files(model_dir)
    want = dict(module.state_dict())
    seen: set[str] = set()
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name, f in files.items():
        target = rename(name)
        if target is None:
            continue
        if target not in want:
            raise CheckpointError(f"{f}: tensor {name!r} is not part of the model the config describes "
                                  "(a config field disagrees with the weights)")
        by_file.setdefault(f, []).append((name, target))
    with torch.no_grad():
        for f, names in by_file.items():
            with safe_open(str(f), "pt") as h:
                for name, target in names:
                    t = h.get_tensor(name)
                    dst = want[target]
                    if tuple(t.shape) != tuple(dst.shape):
                        raise CheckpointError(f"{f}: tensor {name!r} has shape {list(t.shape)}, the config "
                                              f"implies {list(dst.shape)}")
                    dst.copy_(t.to(dst.dtype))
                    seen.add(target)
    missing = sorted(set(want) - seen - derived)
    if missing:
        root = Path(model_dir)
        where = root / INDEX if (root / INDEX).exists() else sorted(set(files.values()))[0]
        raise CheckpointError(f"{where}: tensor {missing[0]!r} is missing from the checkpoint "
                              f"({len(missing)} missing in all)")
    module.to(dtype)
