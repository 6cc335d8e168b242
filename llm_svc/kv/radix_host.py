"""Moves up the tiers of a ``RadixCache`` (``llm_svc.kv.radix``): loading a match's host-only KV
back to the device, and inserting KV that arrives from a lower tier (L3) into the host pools.
Pure bookkeeping: device copies are recorded in the tree's ``ops``; the caller fills inserted
host slots itself. (Moves down the tiers are eviction's: ``llm_svc.kv.radix_evict``.)"""

from __future__ import annotations

from llm_svc.kv.radix_node import NO_SLOT, MatchResult, Node


class HostMover:
    """Host -> device loads and lower tier -> host inserts for a ``RadixCache``; see the module
    doc. Uses the tree's tiers, matching helpers, locks, ``evictor``, ``ops`` and ``stats``."""

    def __init__(self, tree) -> None:
        self.tree = tree

    def load_need(self, m: MatchResult) -> tuple[int, int]:
        """Device ``(full, swa)`` slots that ``load(m)`` allocates."""
        full = sum(len(n.key) for n in m.nodes if n.device.full is None)
        swa = sum(1 for n, i in self.tree.window_positions(m) if n.device.swa[i] == NO_SLOT)
        return full, swa

    def load(self, m: MatchResult) -> bool:
        """Bring a locked match's host-only KV back to the device: full KV of every host-only
        node on the path and SWA KV of its window (the host keeps its copies). Records the copies
        in ``ops`` and fills ``m``'s slot lists. False (nothing changed) if the device cannot make
        room."""
        if not m.needs_load:
            return True
        tree, device = self.tree, self.tree.device
        need_full, need_swa = self.load_need(m)
        if need_full > device.full_pool.num_free + device.evictable_full() or (
            need_swa > device.swa_pool.num_free + device.evictable_swa()
        ):
            return False
        short_full = need_full - device.full_pool.num_free
        short_swa = need_swa - device.swa_pool.num_free
        if short_full > 0 or short_swa > 0:
            tree.evict(max(0, short_full), max(0, short_swa))
        full = device.full_pool.alloc(need_full)
        swa = device.swa_pool.alloc(need_swa)
        assert full is not None and swa is not None, "eviction freed less than it promised"
        at = 0
        for n in m.nodes:  # root first: device residency stays top-closed
            if n.device.full is None:
                slots = full[at:at + len(n.key)]
                at += len(n.key)
                device.set(n, full=slots)
                tree.ops.append(("h2d_full", list(n.host.full), list(slots)))
        src: list[int] = []
        dst: list[int] = []
        window: dict[Node, tuple[list[int], list[int]]] = {}
        it = iter(swa)
        for n, i in tree.window_positions(m):
            if n.device.swa[i] == NO_SLOT:
                s = next(it)
                src.append(n.host.swa[i])
                dst.append(s)
                positions, slots = window.setdefault(n, ([], []))
                positions.append(i)
                slots.append(s)
        for n, (positions, slots) in window.items():
            device.put_swa(n, positions, slots)
        if dst:
            tree.ops.append(("h2d_swa", src, dst))
        tree.stats["loaded_full"] += need_full
        tree.stats["loaded_swa"] += need_swa
        m.full_slots, m.swa_slots = tree.device_slots(m)
        m.needs_load = False
        return True

    # ------------------------------------------------------------------ lower tier -> host
    def insert_host(self, keys: list[int], full_from: int, window_from: int
                    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]] | None:
        """Make the tree hold ``keys`` with full KV (some tier) for every position and SWA KV
        (some tier) for ``[window_from, len(keys))``, allocating host slots for what it lacks
        (KV fetched from a lower tier). Positions ``< full_from`` must already be in the tree.
        Returns ``(full, swa)`` lists of ``(position, host_slot)`` for the caller to fill, or
        None (nothing changed) if positions below ``full_from`` are missing or the host has no
        room."""
        tree = self.tree
        if tree.host is None:
            return None
        n_tok = len(keys)
        path, _ = tree.walk(keys, False)
        raw = sum(k for _, k in path)
        if raw < min(full_from, n_tok):
            return None
        node, nodes = tree.cut(path, raw)
        pin = tree.lock(MatchResult(raw, [], [], node, nodes=nodes))  # host eviction spares the path
        try:
            return self._insert_at(keys, node, nodes, raw, window_from)
        finally:
            tree.unlock(pin)

    def _insert_at(self, keys, node, nodes, raw, window_from):
        tree, host = self.tree, self.tree.host
        n_tok = len(keys)
        new_full = n_tok - raw
        # SWA positions in [window_from, n) lacking SWA in both tiers, per node
        lacking: dict[Node, list[int]] = {}
        pos = 0
        for n in nodes:
            dev_swa, host_swa = n.device.swa, n.host.swa
            for i in range(max(0, window_from - pos), len(n.key)):
                if dev_swa[i] == NO_SLOT and host_swa[i] == NO_SLOT:
                    lacking.setdefault(n, []).append(i)
            pos += len(n.key)
        swa_new = max(0, n_tok - max(raw, window_from))
        hf = tree.evictor.host_alloc_full(new_full)
        if hf is None:
            return None
        hs = tree.evictor.host_alloc_swa(sum(map(len, lacking.values())) + swa_new)
        if hs is None:
            host.full_pool.free(hf)
            return None
        out_full: list[tuple[int, int]] = []
        out_swa: list[tuple[int, int]] = []
        at, pos = 0, 0
        for n in nodes:
            positions = lacking.get(n)
            if positions:
                slots = hs[at:at + len(positions)]
                at += len(positions)
                host.put_swa(n, positions, slots)
                out_swa.extend((pos + i, s) for i, s in zip(positions, slots))
            pos += len(n.key)
        if new_full:
            hswa = [NO_SLOT] * new_full
            for p in range(max(raw, window_from), n_tok):
                hswa[p - raw] = hs[at]
                out_swa.append((p, hs[at]))
                at += 1
            node = tree.add_child(node, list(keys[raw:]))
            host.set(node, full=list(hf), swa=hswa)
            out_full = [(raw + i, s) for i, s in enumerate(hf)]
        tree.touch_path(node, n_tok)
        tree.stats["host_inserted_full"] += len(out_full)
        tree.stats["host_inserted_swa"] += len(out_swa)
        return out_full, out_swa
