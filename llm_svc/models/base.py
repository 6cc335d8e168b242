"""Our forward pass of a hybrid SWA decoder, run over the weights of the loaded HF model.

A model reuses the HF modules that are exact as they are (norms, projections, MLP/MoE, rotary
tables) and does the attention itself: new K/V go to pool tensors, context K/V are read back
through the step's index tensors (see ``llm_svc.attention``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from llm_svc.attention import FULL, SLIDING, AttentionBackend, LayerKV

HF_KIND = {"full_attention": FULL, "sliding_attention": SLIDING}


@dataclass(frozen=True)
class LayerSpec:
    """KV shape of one layer: which pool (``full``/``sliding``) and its head geometry."""

    kind: str
    kv_heads: int
    qk_dim: int
    v_dim: int

    def __post_init__(self) -> None:
        assert self.kind in (FULL, SLIDING), self.kind
        assert min(self.kv_heads, self.qk_dim, self.v_dim) >= 1


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, R] with R <= D: rotate the first R dims (partial rotary)."""
    r = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    rot = x[..., :r] * c + rotate_half(x[..., :r]) * s
    return torch.cat([rot, x[..., r:]], dim=-1) if r < x.shape[-1] else rot


class HybridModel(ABC):
    """Interface the model runner drives; one instance wraps one loaded HF model."""

    layers: list[LayerSpec]
    window: int
    hidden_size: int

    @abstractmethod
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> input embeddings [T, hidden] (media rows are replaced by the runner)."""

    @abstractmethod
    def forward(self, h: torch.Tensor, positions: torch.Tensor, kv: list[LayerKV], attn: AttentionBackend,
                meta: Any) -> torch.Tensor:
        """h [T, hidden] at ``positions [T]`` -> final-normed hidden states [T, hidden]."""

    @abstractmethod
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""

    @contextmanager
    def static_positions(self, bound: int):
        """Inside: every position is below ``bound``, so ``rope_tables`` sizes its tables by it
        instead of reading ``positions.max()`` (a device sync, which a CUDA graph capture
        forbids); once grown to ``bound`` the tables are never reallocated under a graph."""
        old = self.__dict__.get("_positions_bound")
        self._positions_bound = bound
        try:
            yield
        finally:
            self._positions_bound = old

    def rope_tables(self, rotary: torch.nn.Module, h: torch.Tensor, positions: torch.Tensor,
                    layer_types: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """cos/sin ``[T, R]`` per HF layer type (per-type theta/scaling), looked up in a table the
        HF rotary module computed once for positions ``0..N-1`` (element-wise the same numbers
        as calling it per step; grown by doubling when a position passes N)."""
        cache = self.__dict__.setdefault("_rope_cache", {})
        need = self.__dict__.get("_positions_bound") or int(positions.max()) + 1
        out = {}
        for t in sorted(set(layer_types)):
            if t not in cache or cache[t][0].shape[0] < need:
                n = max(need, 2 * cache[t][0].shape[0] if t in cache else 4096)
                pos = torch.arange(n, device=h.device)[None]
                cos, sin = rotary(h[:1][None], pos, t)
                cache[t] = (cos[0], sin[0])
            cos, sin = cache[t]
            out[t] = (cos[positions], sin[positions])
        return out
