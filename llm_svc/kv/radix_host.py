"""Host-tier moves for ``RadixCache`` (``llm_svc.kv.radix``): loading a match's host-only KV
back to the device, and inserting KV that arrives from a lower tier (L3) into the host pools.
Pure bookkeeping: device copies are recorded in ``self.ops``; the caller fills inserted host
slots itself."""

from __future__ import annotations

from llm_svc.kv.radix_node import NO_SLOT, MatchResult, Node


class HostMixin:
    """Host <-> device methods of ``RadixCache``; see the module doc."""

    def load_need(self, m: MatchResult) -> tuple[int, int]:
        """Device ``(full, swa)`` slots that ``load(m)`` allocates."""
        full = sum(len(n.key) for n in m.nodes if n.full is None)
        swa = sum(1 for n, i in self._window_positions(m) if n.swa[i] == NO_SLOT)
        return full, swa

    def load(self, m: MatchResult) -> bool:
        """Bring a locked match's host-only KV back to the device: full KV of every host-only
        node on the path and SWA KV of its window (the host keeps its copies). Records the copies
        in ``ops`` and fills ``m``'s slot lists. False (nothing changed) if the device cannot make
        room."""
        if not m.needs_load:
            return True
        need_full, need_swa = self.load_need(m)
        if need_full > self.full_pool.num_free + self.evictable_full() or (
            need_swa > self.swa_pool.num_free + self.evictable_swa()
        ):
            return False
        short_full = need_full - self.full_pool.num_free
        short_swa = need_swa - self.swa_pool.num_free
        if short_full > 0 or short_swa > 0:
            self.evict(max(0, short_full), max(0, short_swa))
        full = self.full_pool.alloc(need_full)
        swa = self.swa_pool.alloc(need_swa)
        assert full is not None and swa is not None, "eviction freed less than it promised"
        at = 0
        for n in m.nodes:
            if n.full is None:
                n.full = full[at:at + len(n.key)]
                self._leaf_index(n)
                self._leaf_index(n.parent)
                at += len(n.key)
                self.ops.append(("h2d_full", list(n.hfull), list(n.full)))
                self.full_tokens += len(n.key)
                if n.full_lock:
                    self.locked_full += len(n.key)
        src, dst = [], []
        it = iter(swa)
        for n, i in self._window_positions(m):
            if n.swa[i] == NO_SLOT:
                s = next(it)
                src.append(n.hswa[i])
                dst.append(s)
                self._set_swa(n, i, s)
        if dst:
            self.ops.append(("h2d_swa", src, dst))
        self.stats["loaded_full"] += need_full
        self.stats["loaded_swa"] += need_swa
        m.full_slots, m.swa_slots = self._device_slots(m)
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
        if not self.host_enabled:
            return None
        n_tok = len(keys)
        path, _ = self._walk(keys, False)
        raw = sum(k for _, k in path)
        if raw < min(full_from, n_tok):
            return None
        node, nodes = self._cut(path, raw)
        pin = self.lock(MatchResult(raw, [], [], node, nodes=nodes))  # host eviction spares the path
        try:
            return self._insert_host_at(keys, node, nodes, raw, window_from)
        finally:
            self.unlock(pin)

    def _insert_host_at(self, keys, node, nodes, raw, window_from):
        n_tok = len(keys)
        new_full = n_tok - raw
        # SWA positions in [window_from, n) lacking SWA in both tiers
        lacking: list[tuple[Node, int, int]] = []
        pos = 0
        for n in nodes:
            for i in range(len(n.key)):
                p = pos + i
                if p >= window_from and n.swa[i] == NO_SLOT and (n.hswa is None or n.hswa[i] == NO_SLOT):
                    lacking.append((n, i, p))
            pos += len(n.key)
        swa_new = max(0, n_tok - max(raw, window_from))
        hf = self._host_alloc_full(new_full)
        if hf is None:
            return None
        hs = self._host_alloc_swa(len(lacking) + swa_new)
        if hs is None:
            self.host_full_pool.free(hf)
            return None
        out_full: list[tuple[int, int]] = []
        out_swa: list[tuple[int, int]] = []
        it = iter(hs)
        for n, i, p in lacking:
            s = next(it)
            self._set_hswa(n, i, s)
            out_swa.append((p, s))
        if new_full:
            hswa = [NO_SLOT] * new_full
            for p in range(max(raw, window_from), n_tok):
                s = next(it)
                hswa[p - raw] = s
                out_swa.append((p, s))
            new = Node(list(keys[raw:]), None, [NO_SLOT] * new_full, node, list(hf), hswa)
            node.children[keys[raw]] = new
            self._nodes.add(new)
            self._reindex(new)
            self.host_full_tokens += new_full
            self.host_swa_tokens += new.num_hswa
            out_full = [(raw + i, s) for i, s in enumerate(hf)]
            node = new
        self._touch_path(node, n_tok)
        self.stats["host_inserted_full"] += len(out_full)
        self.stats["host_inserted_swa"] += len(out_swa)
        return out_full, out_swa

    def _set_hswa(self, node: Node, i: int, slot: int) -> None:
        if node.hswa is None:
            node.hswa = [NO_SLOT] * len(node.key)
        delta = int(slot != NO_SLOT) - int(node.hswa[i] != NO_SLOT)
        node.hswa[i] = slot
        node.num_hswa += delta
        self._reindex(node)
        self.host_swa_tokens += delta
