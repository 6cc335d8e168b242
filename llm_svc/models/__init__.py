"""Our forward implementations of hybrid SWA decoders, by ``LoadedLM.arch``: each registers itself
in ``MODELS`` (``@MODELS.register(arch)``)."""

from __future__ import annotations

from collections.abc import Callable

from shared.registry import Registry

from .base import HybridModel, LayerSpec


def _load_builtin() -> None:
    from . import gemma3, gpt_oss, mimo  # noqa: F401  (register)


# arch -> model class, built as (hf_model, linear=backend)
MODELS: Registry[Callable[..., HybridModel]] = Registry("model arch of the swa engine", load=_load_builtin)


def build_model(arch: str, hf_model, linear: str = "auto") -> HybridModel:
    """Our forward over a loaded HF model; ``linear``: the backend of its GEMMs (``linear.BACKENDS``)."""
    return MODELS.get(arch)(hf_model, linear=linear)


__all__ = ["MODELS", "HybridModel", "LayerSpec", "build_model"]
