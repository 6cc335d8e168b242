"""Attention backends behind one interface (``base.AttentionBackend``), chosen by name.

``torch_batched`` packs the step's prefill chunks and decodes into padded buckets;
``torch_sdpa_loop`` is the simple reference (one call per prefill chunk); ``torch`` names the
default of the two.
"""

from __future__ import annotations

from collections.abc import Callable

from .base import FULL, SLIDING, AttentionBackend, AttentionParams, LayerKV

_REGISTRY: dict[str, Callable[[], AttentionBackend]] = {}
_ALIASES = {"torch": "torch_batched"}


def register_attention_backend(name: str):
    def deco(cls):
        _REGISTRY[name] = cls
        return cls

    return deco


def create_attention_backend(name: str = "torch") -> AttentionBackend:
    from . import torch_batched, torch_sdpa  # noqa: F401  (register)

    name = _ALIASES.get(name, name)
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(set(_REGISTRY) | set(_ALIASES))}")
    return _REGISTRY[name]()


__all__ = ["FULL", "SLIDING", "AttentionBackend", "AttentionParams", "LayerKV", "create_attention_backend",
           "register_attention_backend"]
