"""KV of pool slots as bytes and back: the page payload of the lower tiers (host -> Redis) and of
a prefill -> decode hand-over (``llm_svc.disagg``).

Layout of ``n`` slots of one kind: for each layer of that kind in model order, K then V of the
slots, ``[kv_heads, n, dim]`` contiguous, in the pools' dtype. ``token_bytes`` is its size per slot.
"""

from __future__ import annotations

import torch

from llm_svc.attention import LayerKV


def token_bytes(pools: list[LayerKV], kinds: list[str], kind: str) -> int:
    """Bytes of one slot of ``kind`` over all its layers (K + V)."""
    return sum(kv.k.shape[0] * (kv.k.shape[2] + kv.v.shape[2]) * kv.k.element_size()
               for kv, k in zip(pools, kinds) if k == kind)


def pack(pools: list[LayerKV], kinds: list[str], kind: str, slots: list[int]) -> bytes:
    """KV of ``slots`` of ``kind`` as bytes (module doc)."""
    parts = []
    for kv, k in zip(pools, kinds):
        if k != kind:
            continue
        idx = torch.tensor(slots, dtype=torch.long, device=kv.k.device)
        for t in (kv.k, kv.v):
            parts.append(t.index_select(1, idx).cpu().contiguous().view(torch.uint8).reshape(-1))
    return torch.cat(parts).numpy().tobytes() if parts else b""


def unpack(pools: list[LayerKV], kinds: list[str], kind: str, data: bytes, slots: list[int],
           rows: list[int] | None = None, n: int | None = None) -> None:
    """Write packed ``data`` into ``slots`` of ``kind``: all its ``len(slots)`` tokens, or (``rows``)
    those token indices of its ``n`` tokens, in order."""
    if rows is not None and not rows:
        return
    n = len(slots) if n is None else n
    assert len(data) == n * token_bytes(pools, kinds, kind), "packed KV of the wrong size"
    if not n:
        return
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    pick = None if rows is None else torch.tensor(rows, dtype=torch.long)
    off = 0
    for kv, k in zip(pools, kinds):
        if k != kind:
            continue
        idx = torch.tensor(slots, dtype=torch.long, device=kv.k.device)
        for t in (kv.k, kv.v):
            heads, _, dim = t.shape
            size = heads * n * dim * t.element_size()
            src = buf[off:off + size].view(t.dtype).view(heads, n, dim)  # [kv_heads, n, dim]
            if pick is not None:
                src = src.index_select(1, pick)
            t.index_copy_(1, idx, src.to(t.device))
            off += size
