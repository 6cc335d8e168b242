"""Eviction for ``RadixCache`` (``llm_svc.kv.radix``): device -> host demotion, dropping, SWA
tombstones, and the host pools' own eviction. Pure bookkeeping: copies are recorded in
``self.ops`` as slot lists for the engine to run.

Policy (documented in the README, "Tiered KV"):
* Device full KV: least recently used *device leaves* (no child on the device) go first, those
  whose last token has no SWA before others (no match can end there). With a host tier the leaf
  is demoted (write-back: copied down only if the host lacks it); without one, or when the host
  cannot make room, it is dropped (with any host-only subtree below it).
* Device SWA: unpinned nodes' SWA is tombstoned by the time it was last needed, windows of
  branch points (>= 2 children) last; what the host lacks is copied down first.
* Host pools: least recently used first, never a locked node; a host-only node goes only as a
  leaf (its parent may follow), a device-resident node just loses its host copy.
* Candidates come from indexes kept by every change to the tree (``RadixCache._reindex`` /
  ``_leaf_index``; ``check_integrity`` proves them exact), never from a scan of every node:
  device SWA / host SWA from the nodes holding it (``_swa_nodes`` / ``_hswa_nodes``), device
  full from the device leaves (``_leaves``), host full from the nodes with a host copy
  (``_hfull_nodes``). The tree grows to tens of thousands of nodes, most of them inner,
  host-only or without a window.
* Slack: the candidates of an index are still ordered on each pass (a heap), so once a pool
  must evict it frees ``EVICT_SLACK`` of its size beyond what was asked (when that much is
  evictable; device SWA ``SWA_EVICT_SLACK``). With full pools every decode step asks for a
  slot per sequence; without slack each ask re-ordered the candidates (with the old scans of
  every node the engine ran 5x slower once its pools filled). The cache holds at most that
  fraction less.
"""

from __future__ import annotations

import heapq
import math

from llm_svc.kv.radix_node import NO_SLOT, Node

EVICT_SLACK = 1 / 64  # of a pool's slots, freed beyond the ask once a scan is needed
# device SWA asks come with every prefill and decode (windows are small, the pool is too), and
# its candidates are sorted: more slack (the cached windows lost are the least recently needed)
SWA_EVICT_SLACK = 1 / 16


def with_slack(needed: int, pool_slots: int, evictable: int, slack: float | None = None) -> int:
    """What to free when ``needed`` slots are asked of a pool of ``pool_slots`` (0 stays 0)."""
    if needed <= 0:
        return 0
    return max(needed, min(evictable, math.ceil(pool_slots * (EVICT_SLACK if slack is None else slack))))


class EvictionMixin:
    """Eviction methods of ``RadixCache``; see the module doc."""

    # ------------------------------------------------------------------ device
    def evictable_full(self) -> int:
        return self.full_tokens - self.locked_full

    def evictable_swa(self) -> int:
        return self.swa_tokens - self.locked_swa

    def evict(self, full_needed: int, swa_needed: int) -> tuple[int, int]:
        """Free at least the asked numbers of device slots if possible; returns ``(full, swa)`` freed."""
        freed_full = freed_swa = 0
        full_needed = with_slack(full_needed, self.full_pool.num_slots, self.evictable_full())
        swa_needed = with_slack(swa_needed, self.swa_pool.num_slots, self.evictable_swa(), SWA_EVICT_SLACK)
        if full_needed > 0:
            self.stats["eviction_scans"] += 1
            heap = [self._leaf_key(n) for n in self._leaves if n.full_lock == 0]
            heapq.heapify(heap)
            while heap and freed_full < full_needed:
                *_, node = heapq.heappop(heap)
                if node.parent is None or node.full is None:
                    continue  # removed with a subtree, or demoted, since it was pushed
                parent = node.parent
                f, s = self._evict_device(node)
                freed_full += f
                freed_swa += s
                if (parent is not self.root and parent.parent is not None and parent.full is not None
                        and parent.full_lock == 0 and not parent.has_device_child()):
                    heapq.heappush(heap, self._leaf_key(parent))
        if swa_needed > freed_swa:
            self.stats["eviction_scans"] += 1
            # windows at branch points (>= 2 children: e.g. the end of a shared system prompt)
            # go last; among the rest, least recently needed first (a heap: only what is freed
            # is ordered, not every candidate)
            heap = [(len(n.children) >= 2, n.swa_access, id(n), n)
                    for n in self._swa_nodes if not n.swa_holders]
            heapq.heapify(heap)
            while heap and freed_swa < swa_needed:
                freed_swa += self._tombstone(heapq.heappop(heap)[3])
        return freed_full, freed_swa

    @staticmethod
    def _leaf_key(n: Node) -> tuple:
        alive_tail = n.swa[-1] != NO_SLOT
        return (alive_tail, n.last_access, id(n), n)

    def _evict_device(self, node: Node) -> tuple[int, int]:
        """Demote ``node`` (an unlocked device leaf) to the host, or drop it; device slots freed."""
        if self.host_enabled and self._copy_down(node, full=True):
            n_full, n_swa = len(node.full), node.num_swa
            self.full_pool.free(node.full)
            self.swa_pool.free([s for s in node.swa if s != NO_SLOT])
            self.full_tokens -= n_full
            self.swa_tokens -= n_swa
            node.full = None
            node.swa = [NO_SLOT] * len(node.key)
            node.num_swa = 0
            self._reindex(node)
            self._leaf_index(node)
            self._leaf_index(node.parent)
            self.stats["demoted_full"] += n_full
            return n_full, n_swa
        return self._remove_subtree(node)

    def _copy_down(self, node: Node, full: bool) -> bool:
        """Give the host what ``node`` holds on the device and the host lacks (its full KV if
        ``full``, its valid SWA tokens). False, nothing changed, if the host cannot hold the full
        KV; SWA the host cannot hold is simply not copied."""
        if full and node.hfull is None:
            hs = self._host_alloc_full(len(node.key), spare=node)
            if hs is None:
                return False
            node.hfull = hs
            self._reindex(node)
            self.host_full_tokens += len(hs)
            self.ops.append(("d2h_full", list(node.full), list(hs)))
        want = [i for i, s in enumerate(node.swa)
                if s != NO_SLOT and (node.hswa is None or node.hswa[i] == NO_SLOT)]
        if want:
            hs = self._host_alloc_swa(len(want), spare=node)
            if hs is not None:
                for i, h in zip(want, hs):
                    self._set_hswa(node, i, h)
                self.ops.append(("d2h_swa", [node.swa[i] for i in want], list(hs)))
                self.stats["demoted_swa"] += len(want)
        return True

    def _remove_subtree(self, node: Node) -> tuple[int, int]:
        """Drop ``node`` and everything below it (unlocked: a lock would pin ``node`` too)."""
        freed_full = freed_swa = 0
        stack = [node]
        order: list[Node] = []
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        for n in reversed(order):  # leaves first
            f, s = self._remove_leaf(n)
            freed_full += f
            freed_swa += s
        return freed_full, freed_swa

    def _remove_leaf(self, node: Node) -> tuple[int, int]:
        """Remove a childless, unlocked node from the tree, freeing its slots in every tier;
        returns the device ``(full, swa)`` slots freed."""
        assert not node.children and node.full_lock == 0 and not node.swa_holders
        parent = node.parent
        del parent.children[node.key[0]]
        self._nodes.discard(node)
        self._swa_nodes.discard(node)
        self._leaves.discard(node)
        self._hfull_nodes.discard(node)
        self._leaf_index(parent)
        swa = [s for s in node.swa if s != NO_SLOT]
        n_full = 0
        if node.full is not None:
            n_full = len(node.full)
            self.full_pool.free(node.full)
            self.full_tokens -= n_full
        self.swa_pool.free(swa)
        self.swa_tokens -= len(swa)
        if node.hfull is not None:
            self.host_full_pool.free(node.hfull)
            self.host_full_tokens -= len(node.hfull)
        self._drop_hswa(node)
        node.parent = None
        self.stats["node_evictions"] += 1
        return n_full, len(swa)

    def _tombstone(self, node: Node) -> int:
        assert not node.swa_holders
        if self.host_enabled and node.full is not None:
            self._copy_down(node, full=False)
        swa = [s for s in node.swa if s != NO_SLOT]
        self.swa_pool.free(swa)
        node.swa = [NO_SLOT] * len(node.swa)
        node.num_swa = 0
        self._reindex(node)
        self.swa_tokens -= len(swa)
        self.stats["swa_evictions"] += 1
        return len(swa)

    # ------------------------------------------------------------------ host
    def _drop_hswa(self, node: Node) -> int:
        if node.hswa is None:
            return 0
        slots = [s for s in node.hswa if s != NO_SLOT]
        self.host_swa_pool.free(slots)
        self.host_swa_tokens -= len(slots)
        node.hswa, node.num_hswa = None, 0
        self._hswa_nodes.discard(node)
        return len(slots)

    def _host_alloc_full(self, n: int, spare: Node | None = None) -> list[int] | None:
        """``n`` host full slots, evicting host entries (never ``spare`` or a locked node)."""
        pool = self.host_full_pool
        if n > pool.num_slots:
            return None
        if n > pool.num_free:
            self._host_evict_full(with_slack(n - pool.num_free, pool.num_slots, pool.num_slots), spare)
        return pool.alloc(n)

    def _host_alloc_swa(self, n: int, spare: Node | None = None) -> list[int] | None:
        pool = self.host_swa_pool
        if n > pool.num_slots:
            return None
        if n > pool.num_free:
            self._host_evict_swa(with_slack(n - pool.num_free, pool.num_slots, pool.num_slots), spare)
        return pool.alloc(n)

    def _host_evictable(self, n: Node, spare: Node | None) -> bool:
        if n is spare or n.full_lock or n.hfull is None or n.parent is None:
            return False
        return n.full is not None or not n.children

    def _host_evict_full(self, needed: int, spare: Node | None) -> None:
        self.stats["eviction_scans"] += 1
        heap = [(n.last_access, id(n), n) for n in self._hfull_nodes if self._host_evictable(n, spare)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < needed:
            *_, n = heapq.heappop(heap)
            if not self._host_evictable(n, spare):
                continue
            freed += len(n.hfull)
            self.stats["host_evictions"] += 1
            if n.full is not None:  # the device keeps it: drop the host copy only
                self.host_full_pool.free(n.hfull)
                self.host_full_tokens -= len(n.hfull)
                n.hfull = None
                self._drop_hswa(n)
                self._reindex(n)
                continue
            parent = n.parent
            self._remove_leaf(n)
            if parent is not self.root and self._host_evictable(parent, spare):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))

    def _host_evict_swa(self, needed: int, spare: Node | None) -> None:
        self.stats["eviction_scans"] += 1
        heap = [(len(n.children) >= 2, n.swa_access, id(n), n)
                for n in self._hswa_nodes if n is not spare and not n.full_lock]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < needed:
            n = heapq.heappop(heap)[3]
            freed += self._drop_hswa(n)
            self.stats["host_swa_evictions"] += 1
