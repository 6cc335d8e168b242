"""Waits on replicas' answers, by replica, that end at once when the replica is lost.

A host cut off the network sends nothing: no reset, no close, so a read on a connection to it
waits for the request timeout (minutes).  The replica pool finds such a host by its silent
probes; ``lose(replica)`` then ends every wait registered on it, and the caller turns that into
a retry (nothing answered yet) or an error (a stream already under way), never a hang."""

from __future__ import annotations

import anyio


class ReplicaLost(Exception):
    """The replica being waited on stopped answering (the pool found it unreachable)."""

    def __init__(self, replica: str) -> None:
        super().__init__(f"{replica} stopped answering (unreachable)")
        self.replica = replica


class InFlightWaits:
    """Open waits per replica.  ``waiting(replica)`` wraps one await (never a ``yield``: a cancel
    scope must not span one); ``lose(replica)`` cancels them all."""

    def __init__(self) -> None:
        self._scopes: dict[str, set[anyio.CancelScope]] = {}
        # waits ended by lose(), ever: before the replica answered (retried elsewhere) and
        # in the middle of its answer (the caller gets an error)
        self.lost = {"before_answer": 0, "mid_answer": 0}

    def open(self, replica: str) -> int:
        return len(self._scopes.get(replica, ()))

    def waiting(self, replica: str, answering: bool = False) -> "_Wait":
        """A context manager that raises ``ReplicaLost`` if ``lose(replica)`` runs while its body
        awaits; ``answering``: the replica has started answering (headers in), so the loss
        reaches the caller."""
        return _Wait(self, replica, answering)

    def lose(self, replica: str) -> int:
        """End every wait on ``replica``; how many there were."""
        scopes = list(self._scopes.get(replica, ()))
        for scope in scopes:
            scope.cancel()
        return len(scopes)


class _Wait:
    """One ``InFlightWaits.waiting`` (a class, not a generator: a stream enters one per read)."""

    __slots__ = ("waits", "replica", "answering", "scope", "scopes")

    def __init__(self, waits: InFlightWaits, replica: str, answering: bool) -> None:
        self.waits, self.replica, self.answering = waits, replica, answering

    def __enter__(self) -> None:
        self.scope = anyio.CancelScope()
        self.scopes = self.waits._scopes.setdefault(self.replica, set())
        self.scopes.add(self.scope)
        self.scope.__enter__()

    def __exit__(self, et, e, tb) -> bool:
        scope, scopes, by_replica = self.scope, self.scopes, self.waits._scopes
        try:
            swallowed = scope.__exit__(et, e, tb)
        finally:
            scopes.discard(scope)
            if not scopes and by_replica.get(self.replica) is scopes:
                del by_replica[self.replica]
        if scope.cancelled_caught:
            self.waits.lost["mid_answer" if self.answering else "before_answer"] += 1
            raise ReplicaLost(self.replica)
        return swallowed
