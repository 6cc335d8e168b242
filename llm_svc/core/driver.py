"""Rank 0 drives the other ranks of a tensor-/expert-parallel group through the calls that
change their state, in the order it makes them; every other rank repeats each call on its own
share (vLLM's ``collective_rpc``, narrowed to what our runner and host tier do):

* ``("run", ForwardBatch)``: one engine step's forward (the all-reduces inside it pair up);
* ``("host", ops)``: the host tier's device <-> host copies of the prefix tree;
* ``("stop",)``: the core is shutting down.

Rank 0 sends each call before making it itself, so no rank waits on a collective another has
not reached. Only rank 0 computes logits and samples."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from llm_svc.parallel import RankGroup

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankSetup:
    """What every rank builds its runner from, decided by rank 0 after it sized the pools."""

    num_full_slots: int
    num_swa_slots: int
    kv_dtype: str  # torch dtype name
    attention: str
    host_full_slots: int = 0
    host_swa_slots: int = 0


class DrivingRunner:
    """Rank 0's ``ModelRunner``: ``run`` is sent to every rank, then run here; the rest is the runner's."""

    def __init__(self, runner, group: RankGroup):
        self._runner = runner
        self.group = group

    def run(self, batch):
        self.group.broadcast(("run", batch))
        return self._runner.run(batch)

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def check_ranks(self) -> None:
        """Every rank's slot tables are rank 0's (the same requests at the same rows and lengths,
        the same slots): the replicated state has not drifted. An ``AssertionError`` names the rank."""
        self.group.broadcast(("check",))
        mine = tables_digest(self._runner)
        for rank, theirs in enumerate(self.group.gather_objects(mine)):
            assert theirs == mine, f"rank {rank}'s slot tables differ from rank 0's"

    def stop(self) -> None:
        """Tell the other ranks to exit (their loops return)."""
        try:
            self.group.broadcast(("stop",))
        except Exception as e:  # a rank already gone: it is being torn down anyway
            log.warning("could not tell the other ranks to stop: %s", e)


class DrivenHost:
    """Rank 0's host tier: each batch of copies is sent to every rank, then made here."""

    def __init__(self, host, group: RankGroup):
        self._host = host
        self.group = group

    def apply(self, ops) -> None:
        self.group.broadcast(("host", ops))
        self._host.apply(ops)

    def __getattr__(self, name):
        return getattr(self._host, name)


def serve_rank(runner, host, group: RankGroup) -> None:
    """A non-zero rank's loop: repeat rank 0's calls until it says stop (or its group breaks)."""
    while True:
        msg = group.broadcast(None)
        op = msg[0]
        if op == "run":
            runner.run(msg[1])
        elif op == "host":
            if host is None:
                raise RuntimeError("rank 0 sent host-tier copies but this rank has no host tier")
            host.apply(msg[1])
        elif op == "check":
            group.gather_objects(tables_digest(runner))
        elif op == "stop":
            return
        else:
            raise RuntimeError(f"unknown call from rank 0: {op!r}")


def tables_digest(runner) -> tuple:
    """What a rank's runner holds of the requests: each row's request, length and slots, and
    its pools' shapes."""
    t = runner.tables
    rows = sorted((rid, row, t.length.get(row, 0)) for rid, row in t.row_of.items())
    slots = [(t.full[row, :n].tolist(), t.swa[row, :n].tolist()) for _, row, n in rows]
    return rows, slots, [(kv.k.shape[1], kv.v.shape[1]) for kv in runner.kv]
