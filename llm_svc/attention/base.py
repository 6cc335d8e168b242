"""Attention backend interface: index tensors of one step in, attention over pool KV out.

The runner calls ``prepare`` once per step (the ``ForwardBatch`` and the runner's persistent
slot tables -> index and mask tensors, built with tensor ops, no per-token Python), then
``forward`` once per layer. A backend owns how context is gathered and
masked, so a GPU kernel (paged/varlen flash attention) can replace the CPU one behind the same
two calls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from llm_svc.types.request import ForwardBatch
from llm_svc.attention.slot_tables import StepTables

FULL, SLIDING = "full", "sliding"


@dataclass
class LayerKV:
    """One layer's pool tensors, head-major: ``k [kv_heads, num_slots, qk_dim]``,
    ``v [kv_heads, num_slots, v_dim]``. Head-major so that a gather of context slots
    (``index_select`` on dim 1) is already in the ``[Hkv * B, L, D]`` layout ``bmm`` reads: the
    context KV is copied once per layer, not gathered and then permuted."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def empty(cls, num_slots: int, kv_heads: int, qk_dim: int, v_dim: int, dtype: torch.dtype,
              device: torch.device | str = "cpu") -> "LayerKV":
        return cls(torch.zeros(kv_heads, num_slots, qk_dim, dtype=dtype, device=device),
                   torch.zeros(kv_heads, num_slots, v_dim, dtype=dtype, device=device))

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots [T] long; k [T, Hkv, Dqk], v [T, Hkv, Dv] (cast to the pool's dtype)."""
        self.k.index_copy_(1, slots, k.transpose(0, 1).to(self.k.dtype))
        self.v.index_copy_(1, slots, v.transpose(0, 1).to(self.v.dtype))

    def gather(self, idx: torch.Tensor, dtype: torch.dtype,
               ws: "Workspace | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Context of ``idx [B, L]`` slots -> ``k [Hkv, B, L, Dqk]``, ``v [Hkv, B, L, Dv]`` in
        ``dtype``. With ``ws`` the results live in its buffers (valid until the next gather)."""
        b, n = idx.shape
        flat = idx.reshape(-1)
        out = []
        for name, pool in (("k", self.k), ("v", self.v)):
            shape = (pool.shape[0], b * n, pool.shape[2])
            if ws is None:
                t = pool.index_select(1, flat).to(dtype)
            else:
                t = ws.get(name, shape, pool.dtype, pool.device)
                for h in range(shape[0]):  # dim-0 row copies per head: the fast index_select path
                    torch.index_select(pool[h], 0, flat, out=t[h])
                if pool.dtype != dtype:
                    t = ws.get(name + "_cast", shape, dtype, pool.device).copy_(t)
            out.append(t.view(pool.shape[0], b, n, -1))
        return out[0], out[1]


class Workspace:
    """Scratch buffers reused across layers and steps, one per name, grown by doubling. The
    gathered context KV is the one big temporary of a decode step (O(B * context)); allocating
    it fresh each layer costs page faults on CPU (measured: ~5x the copy itself at 16 x 8K)."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != torch.device(device):
            old = buf.numel() if buf is not None and buf.dtype == dtype else 0
            buf = torch.empty(max(n, 2 * old), dtype=dtype, device=device)
            self._bufs[name] = buf
        return buf[:n].view(shape)


@dataclass
class AttentionParams:
    """Per-layer constants: softmax ``scale``, optional per-head ``sinks [Hq]`` (MiMo's sliding
    layers) and optional logit ``softcap`` (Gemma 2-style)."""

    scale: float
    sinks: torch.Tensor | None = None
    softcap: float | None = None


class AttentionBackend(ABC):
    """``prepare(batch, tables, window, device)`` once per step, ``forward(...)`` once per layer."""

    name: str = ""

    def bind_pools(self, kv_dtype: torch.dtype) -> None:
        """Told once, by the runner that made the KV pools, what dtype they hold (a backend may
        pick its paths by it: a kernel that reads float32 pools in place, say). Default: nothing."""

    @abstractmethod
    def prepare(self, batch: ForwardBatch, tables: StepTables, window: int, device: torch.device) -> Any:
        """Step metadata for both layer kinds (full: every position, sliding: the last W).
        ``tables`` (already updated with the batch's slots) map each seq's positions to slots."""

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
