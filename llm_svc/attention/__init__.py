"""Attention backends behind one interface (``base.AttentionBackend``), chosen by name.

``torch_batched`` packs the step's prefill chunks and decodes into padded buckets (matmul
softmax); ``sdpa`` uses the same buckets with
``torch.nn.functional.scaled_dot_product_attention`` (a fused kernel on CUDA);
``torch_sdpa_loop`` is the simple reference (one call per prefill chunk); ``cpu_flash`` (the CPU
default) attends the same buckets with torch's CPU flash kernel, and its decodes with our C
kernel reading K/V in place through the slot table (``cpu_paged``); ``triton_paged`` is a paged
Triton kernel reading K/V in place from the pool (CUDA; CPU tests via ``TRITON_INTERPRET=1``). ``torch`` names
``torch_batched``; ``auto`` picks per device (``DEFAULT_BY_DEVICE``). Each backend registers
itself in ``ATTENTION_BACKENDS`` (``@ATTENTION_BACKENDS.register(name)``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shared.registry import Registry

from .base import FULL, SLIDING, AttentionBackend, AttentionParams, LayerKV


def _load_builtin() -> None:
    from . import cpu_flash, sdpa, torch_batched, torch_sdpa  # noqa: F401  (register)
    try:
        from . import triton_paged  # noqa: F401  (register; triton itself is imported at first use)
    except ImportError:  # a missing optional dependency must not hide the other backends
        pass


ATTENTION_BACKENDS: Registry[Callable[[], AttentionBackend]] = Registry(
    "attention backend", load=_load_builtin, also=("auto",))
DEFAULT_BY_DEVICE = {"cuda": "sdpa", "cpu": "cpu_flash"}


def create_attention_backend(name: str = "auto", device: torch.device | str = "cpu") -> AttentionBackend:
    """The backend registered as ``name``; ``auto``: ``DEFAULT_BY_DEVICE`` of ``device``'s type."""
    if name == "auto":
        name = DEFAULT_BY_DEVICE.get(torch.device(device).type, "torch_batched")
    return ATTENTION_BACKENDS.get(name)()


__all__ = ["ATTENTION_BACKENDS", "FULL", "SLIDING", "AttentionBackend", "AttentionParams", "LayerKV",
           "create_attention_backend"]
