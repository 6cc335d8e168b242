"""One tier of the radix tree's KV (device or host): its pools, how many of their slots the tree
holds, and the indexes eviction picks from. Every change to a node's slots in a tier goes through
``Tier.set``, which updates the node's record, the counters and the indexes together."""

from __future__ import annotations

from operator import attrgetter

from llm_svc.kv.pool import SlotPool
from llm_svc.kv.radix_node import NO_SLOT, LockHandle, Node

KEEP: object = object()  # ``Tier.set``: leave this part of the record as it is


class Tier:
    """The slots of one tier held by the tree's nodes (``node.<name>``, a ``TierSlots``).

    ``full_tokens`` / ``swa_tokens``: slots of each pool the tree holds; ``swa_nodes``: the nodes
    holding SWA here (SWA eviction picks among these, not every node: most nodes' windows are
    long gone, the tree grows to tens of thousands of nodes, and SWA is asked for every step)."""

    def __init__(self, name: str, full_pool: SlotPool, swa_pool: SlotPool) -> None:
        self.name = name
        self.full_pool = full_pool
        self.swa_pool = swa_pool
        self.record = attrgetter(name)
        self.full_tokens = 0
        self.swa_tokens = 0
        self.swa_nodes: set[Node] = set()

    def set(self, node: Node, full: list[int] | None = KEEP, swa: list[int] = KEEP) -> None:
        """Give ``node`` these slots in this tier (``full`` ``None``: no full KV here; ``swa``
        one per token, ``NO_SLOT`` where none). The caller hands over owned slots and frees the
        ones it replaces; counters and indexes follow here."""
        rec = self.record(node)
        if full is not KEEP:
            delta = (0 if full is None else len(full)) - (0 if rec.full is None else len(rec.full))
            rec.full = full
            self.full_tokens += delta
            self._full_changed(node, delta)
        if swa is not KEEP:
            n = len(swa) - swa.count(NO_SLOT)
            delta = n - rec.num_swa
            rec.swa, rec.num_swa = swa, n
            self.swa_tokens += delta
            (self.swa_nodes.add if n else self.swa_nodes.discard)(node)
            self._swa_changed(node, delta)

    def put_swa(self, node: Node, positions: list[int], slots: list[int]) -> None:
        """``set`` the SWA slots of some of ``node``'s positions."""
        swa = list(self.record(node).swa)
        for i, s in zip(positions, slots):
            swa[i] = s
        self.set(node, swa=swa)

    def release(self, node: Node, keep_full: bool = False) -> tuple[int, int]:
        """Free ``node``'s slots in this tier (its SWA only, with ``keep_full``); returns the
        ``(full, swa)`` slots freed."""
        rec = self.record(node)
        n_full = 0
        if not keep_full and rec.full is not None:
            n_full = len(rec.full)
            self.full_pool.free(rec.full)
            self.set(node, full=None)
        n_swa = rec.num_swa
        if n_swa:
            self.swa_pool.free([s for s in rec.swa if s != NO_SLOT])
            self.set(node, swa=[NO_SLOT] * len(rec.swa))
        return n_full, n_swa

    def owned_slots(self, nodes: set[Node]) -> tuple[list[int], list[int]]:
        """``(full, swa)`` slots of this tier held by ``nodes``."""
        full: list[int] = []
        swa: list[int] = []
        for n in nodes:
            rec = self.record(n)
            if rec.full is not None:
                full.extend(rec.full)
            if rec.num_swa:
                swa.extend(s for s in rec.swa if s != NO_SLOT)
        return full, swa

    def check(self, nodes: set[Node]) -> None:
        """Raise AssertionError unless the records of ``nodes`` (every node of the tree) agree
        with this tier's counters and indexes, and no slot is held twice."""
        name = self.name
        full_tokens = swa_tokens = 0
        for n in nodes:
            rec = self.record(n)
            assert len(rec.swa) == len(n.key), f"{name}: node lengths differ"
            assert rec.full is None or len(rec.full) == len(n.key), f"{name}: full length differs"
            assert rec.num_swa == sum(s != NO_SLOT for s in rec.swa), f"{name}: num_swa stale"
            full_tokens += 0 if rec.full is None else len(n.key)
            swa_tokens += rec.num_swa
        assert self.swa_nodes == {n for n in nodes if self.record(n).num_swa}, f"{name}: SWA index stale"
        assert (full_tokens, swa_tokens) == (self.full_tokens, self.swa_tokens), f"{name}: tree counters stale"
        for slots in self.owned_slots(nodes):
            assert len(set(slots)) == len(slots), f"{name}: a slot is owned twice in the tree"

    def _full_changed(self, node: Node, delta: int) -> None:
        """Hook: ``node``'s full slots here changed by ``delta`` (indexes to update)."""

    def _swa_changed(self, node: Node, delta: int) -> None:
        """Hook: ``node``'s valid SWA slots here changed by ``delta``."""


class DeviceTier(Tier):
    """The device pools (L1). Also indexes the device *leaves* (device full KV, no child with
    device full KV: the only nodes device eviction may take) and counts the slots locks pin:
    ``locked_full`` (full slots of nodes with ``full_lock``), ``locked_swa`` (SWA slots of nodes
    with SWA holders). Locks change through ``pin_*`` / ``unpin_*``."""

    def __init__(self, full_pool: SlotPool, swa_pool: SlotPool) -> None:
        super().__init__("device", full_pool, swa_pool)
        self.leaves: set[Node] = set()
        self.locked_full = 0
        self.locked_swa = 0

    def evictable_full(self) -> int:
        return self.full_tokens - self.locked_full

    def evictable_swa(self) -> int:
        return self.swa_tokens - self.locked_swa

    def pin_full(self, node: Node) -> None:
        if node.full_lock == 0 and node.device.full is not None:
            self.locked_full += len(node.key)
        node.full_lock += 1

    def unpin_full(self, node: Node) -> None:
        node.full_lock -= 1
        assert node.full_lock >= 0
        if node.full_lock == 0 and node.device.full is not None:
            self.locked_full -= len(node.key)

    def pin_swa(self, node: Node, h: LockHandle) -> None:
        if not node.swa_holders:
            self.locked_swa += node.device.num_swa
        node.swa_holders.add(h)

    def unpin_swa(self, node: Node, h: LockHandle) -> None:
        if h in node.swa_holders:
            node.swa_holders.discard(h)
            if not node.swa_holders:
                self.locked_swa -= node.device.num_swa

    def index_leaf(self, node: Node) -> None:
        """Update ``node``'s membership of the leaf index (for a parent whose children changed)."""
        if node.parent is not None and node.device.full is not None and not node.has_device_child():
            self.leaves.add(node)
        else:
            self.leaves.discard(node)

    def _full_changed(self, node: Node, delta: int) -> None:
        if node.full_lock:
            self.locked_full += delta
        self.index_leaf(node)
        if node.parent is not None:
            self.index_leaf(node.parent)

    def _swa_changed(self, node: Node, delta: int) -> None:
        if node.swa_holders:
            self.locked_swa += delta

    def check(self, nodes: set[Node]) -> None:
        super().check(nodes)
        locked_full = locked_swa = 0
        for n in nodes:
            if n.device.full is None:
                assert n.device.num_swa == 0, "device SWA without device full KV"
            elif n.full_lock:
                locked_full += len(n.key)
            locked_swa += n.device.num_swa if n.swa_holders else 0
        assert self.leaves == {n for n in nodes if n.device.full is not None and not n.has_device_child()}, \
            "device leaf index stale"
        assert (locked_full, locked_swa) == (self.locked_full, self.locked_swa), "device lock counters stale"


class HostTier(Tier):
    """The host pools (L2). Also indexes the nodes with a host copy of their full KV (host full
    eviction picks among these)."""

    def __init__(self, full_pool: SlotPool, swa_pool: SlotPool) -> None:
        super().__init__("host", full_pool, swa_pool)
        self.full_nodes: set[Node] = set()

    def _full_changed(self, node: Node, delta: int) -> None:
        (self.full_nodes.add if node.host.full is not None else self.full_nodes.discard)(node)

    def check(self, nodes: set[Node]) -> None:
        super().check(nodes)
        assert self.full_nodes == {n for n in nodes if n.host.full is not None}, "host full index stale"
