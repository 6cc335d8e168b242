"""Host (L2) KV tensors beside a runner's device pools, and the copies between them.

Layout is the device pools' (``LayerKV``: head-major ``[kv_heads, slots, dim]``), one tensor pair
per layer: full layers index host full slots, sliding layers host SWA slots. On CUDA the host
tensors are pinned; on either device every page is committed at start. A copy op is
``(kind, src_slots, dst_slots)`` as ``RadixCache`` records it.

Bytes for a lower tier (``pack`` / ``unpack``): for each layer of one kind in model order, K then V
of the given slots, ``[kv_heads, n, dim]`` contiguous, in the pools' dtype.
"""

from __future__ import annotations

import torch

from llm_svc.attention import FULL, LayerKV
from llm_svc.offload import kv_pack


class HostKV:
    """Host pools for ``device_kv`` (the runner's per-layer pools) with layer ``kinds``."""

    def __init__(self, device_kv: list[LayerKV], kinds: list[str], num_full: int, num_swa: int) -> None:
        assert len(device_kv) == len(kinds)
        self.device_kv = device_kv
        self.kinds = kinds
        pin = device_kv[0].k.is_cuda
        self.host: list[LayerKV] = []
        # zeros, not empty: every page is written (committed) now, as pinning does on CUDA. The
        # configured bound is then resident from the start (RSS flat while the tier fills, and a
        # bound the machine cannot hold fails here, not hours later under load)
        for kv, kind in zip(device_kv, kinds):
            n = num_full if kind == FULL else num_swa
            heads, _, dk = kv.k.shape
            dv = kv.v.shape[2]
            self.host.append(LayerKV(torch.zeros(heads, n, dk, dtype=kv.k.dtype, pin_memory=pin),
                                     torch.zeros(heads, n, dv, dtype=kv.v.dtype, pin_memory=pin)))
        self.bytes_d2h = 0
        self.bytes_h2d = 0

    def nbytes(self) -> int:
        return sum(t.k.numel() * t.k.element_size() + t.v.numel() * t.v.element_size() for t in self.host)

    def token_bytes(self, kind: str) -> int:
        """Bytes of one token of ``kind`` over all its layers (K + V)."""
        return kv_pack.token_bytes(self.device_kv, self.kinds, kind)

    def apply(self, ops: list[tuple[str, list[int], list[int]]]) -> None:
        """Run the tree's copies in order (an op may reuse a slot an earlier one freed)."""
        for op, src, dst in ops:
            if not src:
                continue
            direction, kind = op.split("_")
            kind = FULL if kind == "full" else "sliding"
            for i, (dev, host) in enumerate(zip(self.device_kv, self.host)):
                if self.kinds[i] != kind:
                    continue
                a, b = (dev, host) if direction == "d2h" else (host, dev)
                s = torch.tensor(src, dtype=torch.long, device=a.k.device)
                d = torch.tensor(dst, dtype=torch.long, device=b.k.device)
                for x, y in ((a.k, b.k), (a.v, b.v)):
                    y.index_copy_(1, d, x.index_select(1, s).to(y.device, non_blocking=True))
            n = len(src) * self.token_bytes(kind)
            if direction == "d2h":
                self.bytes_d2h += n
            else:
                self.bytes_h2d += n
        if self.device_kv[0].k.is_cuda:
            torch.cuda.current_stream().synchronize()  # host tensors are read/written next

    def pack(self, kind: str, slots: list[int]) -> bytes:
        """KV of device ``slots`` of ``kind`` as bytes (module doc; ``llm_svc.offload.kv_pack``)."""
        return kv_pack.pack(self.device_kv, self.kinds, kind, slots)

    def unpack_to_host(self, kind: str, data: bytes, n: int, rows: list[int], host_slots: list[int]) -> None:
        """Write rows ``rows`` (token indices in ``data``, ``n`` tokens in all) of packed ``data``
        into host ``host_slots`` of ``kind``."""
        kv_pack.unpack(self.host, self.kinds, kind, data, host_slots, rows=rows, n=n)
