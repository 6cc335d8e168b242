"""Attention backends behind one interface (``base.AttentionBackend``), chosen by name.

``torch_batched`` packs the step's prefill chunks and decodes into padded buckets (matmul
softmax; the fastest correct path measured on CPU); ``sdpa`` uses the same buckets with
``torch.nn.functional.scaled_dot_product_attention`` (a fused kernel on CUDA);
``torch_sdpa_loop`` is the simple reference (one call per prefill chunk). ``torch`` names
``torch_batched``; ``auto`` picks per device (``DEFAULT_BY_DEVICE``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .base import FULL, SLIDING, AttentionBackend, AttentionParams, LayerKV

_REGISTRY: dict[str, Callable[[], AttentionBackend]] = {}
_ALIASES = {"torch": "torch_batched"}
DEFAULT_BY_DEVICE = {"cuda": "sdpa", "cpu": "torch_batched"}


def register_attention_backend(name: str):
    def deco(cls):
        _REGISTRY[name] = cls
        return cls

    return deco


def create_attention_backend(name: str = "auto", device: torch.device | str = "cpu") -> AttentionBackend:
    """The backend registered as ``name``; ``auto``: ``DEFAULT_BY_DEVICE`` of ``device``'s type."""
    from . import sdpa, torch_batched, torch_sdpa  # noqa: F401  (register)

    if name == "auto":
        name = DEFAULT_BY_DEVICE.get(torch.device(device).type, "torch_batched")
    name = _ALIASES.get(name, name)
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(set(_REGISTRY) | set(_ALIASES) | {'auto'})}")
    return _REGISTRY[name]()


__all__ = ["FULL", "SLIDING", "AttentionBackend", "AttentionParams", "LayerKV", "create_attention_backend",
           "register_attention_backend"]
