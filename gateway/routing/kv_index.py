"""The router keys each LLM replica holds, folded from their KV events (``shared.kv_events``).

Replicas are known by instance id (``/readyz`` ``kv_instance``). Events of an instance apply in
order of their ``seq``; an instance whose next event does not follow its last one (a lost or
trimmed event), or that was never loaded, is *stale* until ``load`` gives it a snapshot, and
routing does not trust it meanwhile. Pure bookkeeping: ``KVEventFeed`` does the I/O."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from shared.kv_events import KVEvent, KVSnapshot
from shared.prefix_keys import leading_held


class KVIndex:
    def __init__(self) -> None:
        self._keys: dict[str, set[int]] = {}
        self._seq: dict[str, int] = {}
        self._stale: set[str] = set()
        self.total = 0  # keys over all instances

    def instances(self) -> list[str]:
        return list(self._seq)

    def stale(self) -> set[str]:
        return set(self._stale)

    def live(self, instance: str | None) -> bool:
        return instance is not None and instance in self._seq and instance not in self._stale

    def seq(self, instance: str) -> int | None:
        return self._seq.get(instance)

    def holds(self, instance: str, key: int) -> bool:
        return key in self._keys.get(instance, ())

    def match_len(self, instance: str, blocks: Sequence[int]) -> int:
        """Leading ``blocks`` the instance holds."""
        return leading_held(self._keys.get(instance), blocks)

    def apply(self, ev: KVEvent) -> bool:
        """Fold one event; False when it cannot be (the instance is then stale: load a snapshot)."""
        seq = self._seq.get(ev.instance)
        if seq is None:
            if ev.seq != 1:  # an instance seen mid-stream: its earlier state is unknown
                self._seq[ev.instance] = 0
                self._keys[ev.instance] = set()
                self._stale.add(ev.instance)
                return False
            seq = self._seq[ev.instance] = 0
            self._keys[ev.instance] = set()
        if ev.seq <= seq:
            return True  # already in a snapshot or applied
        if ev.seq != seq + 1 or ev.instance in self._stale:
            self._stale.add(ev.instance)
            return False
        keys = self._keys[ev.instance]
        before = len(keys)
        if ev.clear:
            keys.clear()
        keys.update(ev.stored)
        keys.difference_update(ev.removed)
        self.total += len(keys) - before
        self._seq[ev.instance] = ev.seq
        return True

    def load(self, snap: KVSnapshot) -> None:
        """The instance's keys as of ``snap.seq``; later events apply on top."""
        self.total += len(snap.keys) - len(self._keys.get(snap.instance, ()))
        self._keys[snap.instance] = set(snap.keys)
        self._seq[snap.instance] = snap.seq
        self._stale.discard(snap.instance)

    def mark_stale(self, instances: Iterable[str] | None = None) -> None:
        """Distrust these instances (all when None) until each is loaded again."""
        self._stale.update(self._seq if instances is None else (i for i in instances if i in self._seq))

    def forget(self, instance: str) -> None:
        self.total -= len(self._keys.pop(instance, ()))
        self._seq.pop(instance, None)
        self._stale.discard(instance)

    def check_integrity(self) -> None:
        """Raise AssertionError if the per-instance records or the total disagree."""
        assert set(self._keys) == set(self._seq), "keys and seq know different instances"
        assert self._stale <= set(self._seq), "stale instance not in the index"
        assert all(s >= 0 for s in self._seq.values()), "negative seq"
        assert self.total == sum(len(k) for k in self._keys.values()), "total differs from the key sets"
