"""Our forward implementations of hybrid SWA decoders, by ``LoadedLM.arch``."""

from __future__ import annotations

from collections.abc import Callable

from .base import HybridModel, LayerSpec

_REGISTRY: dict[str, Callable] = {}


def register_model(arch: str):
    def deco(cls):
        _REGISTRY[arch] = cls
        return cls

    return deco


def build_model(arch: str, hf_model, linear: str = "auto") -> HybridModel:
    """Our forward over a loaded HF model; ``linear``: the backend of its GEMMs (``linear.BACKENDS``)."""
    from . import gemma3, gpt_oss, mimo  # noqa: F401  (register)

    if arch not in _REGISTRY:
        raise ValueError(f"the swa engine has no model for arch {arch!r} (supported: {sorted(_REGISTRY)})")
    return _REGISTRY[arch](hf_model, linear=linear)


__all__ = ["HybridModel", "LayerSpec", "build_model", "register_model"]
