"""Eviction for ``RadixCache`` (``llm_svc.kv.radix``): device -> host demotion, dropping, SWA
tombstones, and the host pools' own eviction. Pure bookkeeping: copies are recorded in the
tree's ``ops`` as slot lists for the engine to run.

Policy (documented in docs/engine.md, "Prefix tree and tiers"):
* Device full KV: least recently used *device leaves* (no child on the device) go first, those
  whose last token has no SWA before others (no match can end there). With a host tier the leaf
  is demoted (write-back: copied down only if the host lacks it); without one, or when the host
  cannot make room, it is dropped (with any host-only subtree below it).
* Device SWA: unpinned nodes' SWA is tombstoned by the time it was last needed, windows of
  branch points (>= 2 children) last; what the host lacks is copied down first.
* Host pools: least recently used first, never a locked node; a host-only node goes only as a
  leaf (its parent may follow), a device-resident node just loses its host copy.
* Candidates come from the indexes each tier keeps with every change of a node's slots
  (``llm_svc.kv.radix_tier``; ``check_integrity`` proves them exact), never from a scan of
  every node: device SWA / host SWA from the nodes holding it (``swa_nodes``), device full from
  the device leaves (``DeviceTier.leaves``), host full from the nodes with a host copy
  (``HostTier.full_nodes``). The tree grows to tens of thousands of nodes, most of them inner,
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


class Evictor:
    """Frees slots of a ``RadixCache``'s tiers by the policy above; see the module doc. Uses the
    tree's tiers, ``root``, ``remove_leaf``, ``ops`` and ``stats``."""

    def __init__(self, tree) -> None:
        self.tree = tree

    # ------------------------------------------------------------------ device
    def evict(self, full_needed: int, swa_needed: int) -> tuple[int, int]:
        """Free at least the asked numbers of device slots if possible; returns ``(full, swa)`` freed."""
        tree, device = self.tree, self.tree.device
        freed_full = freed_swa = 0
        full_needed = with_slack(full_needed, device.full_pool.num_slots, device.evictable_full())
        swa_needed = with_slack(swa_needed, device.swa_pool.num_slots, device.evictable_swa(), SWA_EVICT_SLACK)
        if full_needed > 0:
            tree.stats["eviction_scans"] += 1
            heap = [self._leaf_key(n) for n in device.leaves if n.full_lock == 0]
            heapq.heapify(heap)
            while heap and freed_full < full_needed:
                *_, node = heapq.heappop(heap)
                if node.parent is None or node.device.full is None:
                    continue  # removed with a subtree, or demoted, since it was pushed
                parent = node.parent
                f, s = self._evict_device(node)
                freed_full += f
                freed_swa += s
                if parent in device.leaves and parent.full_lock == 0:
                    heapq.heappush(heap, self._leaf_key(parent))
        if swa_needed > freed_swa:
            tree.stats["eviction_scans"] += 1
            # windows at branch points (>= 2 children: e.g. the end of a shared system prompt)
            # go last; among the rest, least recently needed first (a heap: only what is freed
            # is ordered, not every candidate)
            heap = [(len(n.children) >= 2, n.swa_access, id(n), n)
                    for n in device.swa_nodes if not n.swa_holders]
            heapq.heapify(heap)
            while heap and freed_swa < swa_needed:
                freed_swa += self._tombstone(heapq.heappop(heap)[3])
        return freed_full, freed_swa

    @staticmethod
    def _leaf_key(n: Node) -> tuple:
        alive_tail = n.device.swa[-1] != NO_SLOT
        return (alive_tail, n.last_access, id(n), n)

    def _evict_device(self, node: Node) -> tuple[int, int]:
        """Demote ``node`` (an unlocked device leaf) to the host, or drop it; device slots freed."""
        if self.tree.host is not None and self._copy_down(node, full=True):
            freed = self.tree.device.release(node)
            self.tree.stats["demoted_full"] += freed[0]
            return freed
        return self._remove_subtree(node)

    def _copy_down(self, node: Node, full: bool) -> bool:
        """Give the host what ``node`` holds on the device and the host lacks (its full KV if
        ``full``, its valid SWA tokens). False, nothing changed, if the host cannot hold the full
        KV; SWA the host cannot hold is simply not copied."""
        tree, dev, host = self.tree, node.device, node.host
        if full and host.full is None:
            hs = self.host_alloc_full(len(node.key), spare=node)
            if hs is None:
                return False
            tree.host.set(node, full=hs)
            tree.ops.append(("d2h_full", list(dev.full), list(hs)))
        if not dev.num_swa:
            return True
        want = [i for i, s in enumerate(dev.swa) if s != NO_SLOT and host.swa[i] == NO_SLOT]
        if want:
            hs = self.host_alloc_swa(len(want), spare=node)
            if hs is not None:
                tree.host.put_swa(node, want, hs)
                tree.ops.append(("d2h_swa", [dev.swa[i] for i in want], list(hs)))
                tree.stats["demoted_swa"] += len(want)
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
            f, s = self.tree.remove_leaf(n)
            freed_full += f
            freed_swa += s
        return freed_full, freed_swa

    def _tombstone(self, node: Node) -> int:
        assert not node.swa_holders
        if self.tree.host is not None and node.device.full is not None:
            self._copy_down(node, full=False)
        self.tree.stats["swa_evictions"] += 1
        return self.tree.device.release(node, keep_full=True)[1]

    # ------------------------------------------------------------------ host
    def host_alloc_full(self, n: int, spare: Node | None = None) -> list[int] | None:
        """``n`` host full slots, evicting host entries (never ``spare`` or a locked node)."""
        pool = self.tree.host.full_pool
        if n > pool.num_slots:
            return None
        if n > pool.num_free:
            self._host_evict_full(with_slack(n - pool.num_free, pool.num_slots, pool.num_slots), spare)
        return pool.alloc(n)

    def host_alloc_swa(self, n: int, spare: Node | None = None) -> list[int] | None:
        pool = self.tree.host.swa_pool
        if n > pool.num_slots:
            return None
        if n > pool.num_free:
            self._host_evict_swa(with_slack(n - pool.num_free, pool.num_slots, pool.num_slots), spare)
        return pool.alloc(n)

    @staticmethod
    def _host_evictable(n: Node, spare: Node | None) -> bool:
        if n is spare or n.full_lock or n.host.full is None or n.parent is None:
            return False
        return n.device.full is not None or not n.children

    def _host_evict_full(self, needed: int, spare: Node | None) -> None:
        tree = self.tree
        tree.stats["eviction_scans"] += 1
        heap = [(n.last_access, id(n), n) for n in tree.host.full_nodes if self._host_evictable(n, spare)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < needed:
            *_, n = heapq.heappop(heap)
            if not self._host_evictable(n, spare):
                continue
            freed += len(n.key)
            tree.stats["host_evictions"] += 1
            if n.device.full is not None:  # the device keeps it: drop the host copy only
                tree.host.release(n)
                continue
            parent = n.parent
            tree.remove_leaf(n)
            if parent is not tree.root and self._host_evictable(parent, spare):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))

    def _host_evict_swa(self, needed: int, spare: Node | None) -> None:
        tree = self.tree
        tree.stats["eviction_scans"] += 1
        heap = [(len(n.children) >= 2, n.swa_access, id(n), n)
                for n in tree.host.swa_nodes if n is not spare and not n.full_lock]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < needed:
            n = heapq.heappop(heap)[3]
            freed += tree.host.release(n, keep_full=True)[1]
            tree.stats["host_swa_evictions"] += 1
