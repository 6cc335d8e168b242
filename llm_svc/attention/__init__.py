"""Attention backends behind one interface (``base.AttentionBackend``), chosen by name."""

from __future__ import annotations

from collections.abc import Callable

from .base import FULL, SLIDING, AttentionBackend, AttentionParams, LayerKV

_REGISTRY: dict[str, Callable[[], AttentionBackend]] = {}


def register_attention_backend(name: str):
    def deco(cls):
        _REGISTRY[name] = cls
        return cls

    return deco


def create_attention_backend(name: str = "torch") -> AttentionBackend:
    from . import torch_sdpa  # noqa: F401  (registers "torch")

    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(_REGISTRY)}")
    return _REGISTRY[name]()


__all__ = ["FULL", "SLIDING", "AttentionBackend", "AttentionParams", "LayerKV", "create_attention_backend",
           "register_attention_backend"]
