"""Attention backend interface: index tensors of one step in, attention over pool KV out.

The runner calls ``prepare`` once per step (plain ints of the ``ForwardBatch`` -> index and
mask tensors), then ``forward`` once per layer. A backend owns how context is gathered and
masked, so a GPU kernel (paged/varlen flash attention) can replace the CPU one behind the same
two calls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from llm_svc.engine.forward_batch import ForwardBatch

FULL, SLIDING = "full", "sliding"


@dataclass
class LayerKV:
    """One layer's pool tensors: ``k [num_slots, kv_heads, qk_dim]``, ``v [num_slots, kv_heads, v_dim]``."""

    k: torch.Tensor
    v: torch.Tensor

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k.index_copy_(0, slots, k.to(self.k.dtype))
        self.v.index_copy_(0, slots, v.to(self.v.dtype))


@dataclass
class AttentionParams:
    """Per-layer constants: softmax ``scale``, optional per-head ``sinks [Hq]`` (MiMo's sliding
    layers) and optional logit ``softcap`` (Gemma 2-style)."""

    scale: float
    sinks: torch.Tensor | None = None
    softcap: float | None = None


class AttentionBackend(ABC):
    """``prepare(batch, window)`` once per step, ``forward(...)`` once per layer."""

    name: str = ""

    @abstractmethod
    def prepare(self, batch: ForwardBatch, window: int, device: torch.device) -> Any:
        """Step metadata for both layer kinds (full: every position, sliding: the last W)."""

    @abstractmethod
    def forward(
        self,
        kind: str,
        q: torch.Tensor,  # [T, Hq, Dqk], rope applied; T = batch.num_tokens in batch order
        k: torch.Tensor,  # [T, Hkv, Dqk]
        v: torch.Tensor,  # [T, Hkv, Dv]
        cache: LayerKV,
        meta: Any,
        params: AttentionParams,
    ) -> torch.Tensor:
        """Write the new K/V at the step's out slots of ``kind``'s pool, then attend over each
        sequence's context; returns ``[T, Hq, Dv]``."""
