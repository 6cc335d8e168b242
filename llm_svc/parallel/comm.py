"""This process's place in its rank group and the collectives the forward pass and the engine
core need. One group per replica: every rank runs the same layers on its share of the weights
and sums its partial outputs with ``all_reduce``; rank 0 also drives the others with
``broadcast`` (the step's inputs, the KV copies), so the order of calls is the same on every rank.

On the CPU the group is gloo over TCP on 127.0.0.1 (the ranks of one host); on CUDA the
all-reduce is NCCL and the objects go over a gloo group beside it (NCCL moves tensors only)."""

from __future__ import annotations

import datetime
import logging
import os
import time
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

# a rank that does not answer a collective this long is taken as dead (the front's watchdog
# restarts a silent core sooner; this bounds a rank's own wait)
COLLECTIVE_TIMEOUT_S = 120


@dataclass
class RankGroup:
    """``rank`` of ``world``; ``world == 1`` is the single-process group whose collectives are no-ops."""

    rank: int = 0
    world: int = 1
    backend: str = "none"
    device: str = "cpu"
    _objects: object = None  # the gloo group objects go over (None: the default group)
    comm_s: float = 0.0  # seconds in all_reduce and broadcast since the last ``take_comm_s`` (tp_scaling reads it)
    shm: object = None  # ``shm.ShmChannel``: CPU ranks on one host (None: gloo / NCCL only)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks in place (every rank gets the same result); returns ``t``."""
        if self.world == 1:
            return t
        import torch.distributed as dist

        t0 = time.perf_counter()
        if self.shm is not None and self.shm.fits(t):
            self.shm.all_reduce(t, COLLECTIVE_TIMEOUT_S)
        elif t.dtype == torch.bfloat16 and self.backend == "gloo":
            # gloo sums bfloat16 in bfloat16 per step of its ring; sum in float32, as one rank would
            w = t.float()
            dist.all_reduce(w)
            t.copy_(w)
        else:
            dist.all_reduce(t)
        self.comm_s += time.perf_counter() - t0
        return t

    def take_comm_s(self) -> float:
        s, self.comm_s = self.comm_s, 0.0
        return s

    def broadcast(self, obj=None):
        """Rank 0's ``obj`` on every rank (pickled; rank 0 returns its own)."""
        if self.world == 1:
            return obj
        import torch.distributed as dist

        t0 = time.perf_counter()
        try:
            return self._broadcast(obj)
        finally:
            self.comm_s += time.perf_counter() - t0

    def _broadcast(self, obj):
        import torch.distributed as dist

        if self.shm is not None:
            if self.rank == 0:
                try:
                    return self.shm.broadcast(obj)
                except OverflowError:  # larger than the segment's area: say so there, send it by gloo
                    self.shm.broadcast(_VIA_GLOO)
            elif (got := self.shm.broadcast()) != _VIA_GLOO:
                return got
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._objects)
        return box[0]

    def gather_objects(self, obj) -> list | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self._objects)
        return out

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if self.world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


SINGLE = RankGroup()
_VIA_GLOO = ("__mmserve_via_gloo__",)
SHM_SLOT_BYTES = 32 << 20  # the largest all-reduce through shared memory (larger ones: gloo)
SHM_OBJ_BYTES = 16 << 20  # the largest broadcast through it


def init_group(rank: int, world: int, port: int, backend: str, device: str = "cpu",
               timeout_s: float = COLLECTIVE_TIMEOUT_S, shm: bool = True) -> RankGroup:
    """Join the group of ``world`` ranks whose rendezvous is ``tcp://127.0.0.1:port`` (rank 0 listens).
    ``shm`` (CPU ranks, gloo, x86-64): all-reduces and broadcasts go through a shared-memory
    segment (``shm.ShmChannel``), gloo only for what does not fit."""
    if world == 1:
        return RankGroup(device=device)
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device).index or 0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timeout)
    objects = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
    channel = None
    from . import shm as shm_mod

    if shm and backend == "gloo" and not device.startswith("cuda") and shm_mod.supported():
        box = [shm_mod.new_path() if rank == 0 else None]
        if rank == 0:
            channel = shm_mod.ShmChannel(box[0], 0, world, SHM_SLOT_BYTES, SHM_OBJ_BYTES, create=True)
        dist.broadcast_object_list(box, src=0)
        if rank != 0:
            channel = shm_mod.ShmChannel(box[0], rank, world, SHM_SLOT_BYTES, SHM_OBJ_BYTES, create=False)
        dist.barrier()
        if rank == 0:
            os.unlink(box[0])  # every rank has it mapped; no name is left behind, whatever happens next
    log.info("rank %d of %d joined (%s%s)", rank, world, backend, " + shared memory" if channel else "")
    return RankGroup(rank, world, backend, device, objects, shm=channel)
