"""SWA-aware radix prefix cache over two tiers: the device pools (L1) and host pools (L2).

Keys are per-token ints (token ids, or media-hash keys at placeholder positions). Each node
holds, per tier, a record of its slots (``TierSlots``): per token a full-pool slot and a SWA-pool
slot or ``-1`` (a *tombstone*: SWA KV freed, full KV kept). Contract:

* A match of length ``L`` is *window-safe*: every position in ``[0, L)`` has full KV and every
  position in ``[max(0, L-W), L)`` has SWA KV, each in some tier. Anything longer is clipped, so
  a prefill resuming at ``L`` never reads freed SWA KV. A match that reaches into host-only KV
  is brought back by ``load`` (it records host->device copies) before its slots are used.
* The tree owns the slots in its nodes. ``insert`` takes ownership of the caller's slots from
  ``owned_from`` on; slots for keys already present are freed (never double-owned), and a
  caller's SWA slot over a tombstone revives it.
* Handles must be locked (``lock``) before their slots are used and unlocked when done. A full
  lock pins the whole path (never evicted from either tier); a SWA lock pins the SWA of the nodes
  covering the last ``W`` matched tokens. Every holder of a node's lock also holds its
  ancestors' full lock, so an unlocked node has an unlocked subtree.
* Device residency is top-closed: a node with full KV on the device has a parent with full KV on
  the device, so a match is a device part followed by a host part.
* ``evict`` (``llm_svc.kv.radix_evict``) frees device slots: LRU device leaves are *demoted* to
  the host (write-back: copied down if the host lacks them, then freed on the device) or dropped
  when the host has no room; SWA is tombstoned by the time it was last needed, copied down first.
  Host pools evict their own LRU entries to make room. Every copy is an op in ``ops`` (lists of
  slot ids, no tensors): the engine runs them, in order, before the next forward.

Who keeps what: each tier (``llm_svc.kv.radix_tier``) its pools, counters and indexes, changed
only through its ``set``; this class the token-level tree (matching, splitting, locking,
insertion); ``Evictor`` moves KV down the tiers, ``HostMover`` up (``load``, ``insert_host``).
"""

from __future__ import annotations

import itertools

from llm_svc.kv.pool import SlotPool
from llm_svc.kv.radix_evict import Evictor
from llm_svc.kv.radix_host import HostMover
from llm_svc.kv.radix_node import NO_SLOT, LockHandle, MatchResult, Node, common_len
from llm_svc.kv.radix_tier import DeviceTier, HostTier, Tier

__all__ = ["NO_SLOT", "LockHandle", "MatchResult", "Node", "RadixCache"]


class RadixCache:
    """The tree over two device ``SlotPool``s and, optionally, two host ones."""

    def __init__(self, window: int, full_pool: SlotPool, swa_pool: SlotPool,
                 host_full_pool: SlotPool | None = None, host_swa_pool: SlotPool | None = None) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        if (host_full_pool is None) != (host_swa_pool is None):
            raise ValueError("the host tier needs both a full and a SWA pool")
        self.window = window
        self.device = DeviceTier(full_pool, swa_pool)
        self.host = None if host_full_pool is None else HostTier(host_full_pool, host_swa_pool)
        self.tiers: tuple[Tier, ...] = (self.device,) if self.host is None else (self.device, self.host)
        self.root = Node([], None, self.host is not None)
        self.device.set(self.root, full=[])
        self.root.full_lock = 1  # never evicted
        self._nodes: set[Node] = set()
        self._clock = itertools.count(1)
        # (kind, src slots, dst slots), kind in h2d_full / h2d_swa / d2h_full / d2h_swa
        self.ops: list[tuple[str, list[int], list[int]]] = []
        self.stats = {
            "node_evictions": 0, "swa_evictions": 0, "revived_tokens": 0,
            "demoted_full": 0, "demoted_swa": 0, "loaded_full": 0, "loaded_swa": 0,
            "host_evictions": 0, "host_swa_evictions": 0, "host_inserted_full": 0, "host_inserted_swa": 0,
            "eviction_scans": 0,  # passes over an eviction index (its candidates put in a heap)
        }
        self.evictor = Evictor(self)
        self.mover = HostMover(self)

    # device / host slots the tree owns, and device slots pinned by locks (each tier counts its own)
    full_tokens = property(lambda self: self.device.full_tokens)
    swa_tokens = property(lambda self: self.device.swa_tokens)
    locked_full = property(lambda self: self.device.locked_full)
    locked_swa = property(lambda self: self.device.locked_swa)
    host_full_tokens = property(lambda self: 0 if self.host is None else self.host.full_tokens)
    host_swa_tokens = property(lambda self: 0 if self.host is None else self.host.swa_tokens)

    def evictable_full(self) -> int:
        return self.device.evictable_full()

    def evictable_swa(self) -> int:
        return self.device.evictable_swa()

    def take_ops(self) -> list[tuple[str, list[int], list[int]]]:
        ops, self.ops = self.ops, []
        return ops

    # ------------------------------------------------------------------ moves between tiers
    def evict(self, full_needed: int, swa_needed: int) -> tuple[int, int]:
        """Free at least the asked numbers of device slots if possible; returns ``(full, swa)``
        freed (``Evictor.evict``)."""
        return self.evictor.evict(full_needed, swa_needed)

    def load(self, m: MatchResult) -> bool:
        """Bring a locked match's host-only KV to the device (``HostMover.load``)."""
        return self.mover.load(m)

    def insert_host(self, keys: list[int], full_from: int, window_from: int
                    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]] | None:
        """Host slots for KV of ``keys`` from a lower tier (``HostMover.insert_host``)."""
        return self.mover.insert_host(keys, full_from, window_from)

    # ------------------------------------------------------------------ matching
    def match_prefix(self, keys: list[int], forbidden_ends: list[tuple[int, int]] = (),
                     device_only: bool = False) -> MatchResult:
        """Longest window-safe cached prefix of ``keys`` (in any tier, or on the device only);
        an end ``L`` with ``s < L < e`` for a ``(s, e)`` in ``forbidden_ends`` is not allowed
        either (e.g. inside a bidirectional span). Splits the node at ``L`` and marks the path
        recently used. Does not lock."""
        path, swa = self.walk(keys, device_only)
        length = self._safe_length(swa, len(swa), forbidden_ends)
        node, nodes = self.cut(path, length)
        self.touch_path(node, length)
        m = MatchResult(length, [], [], node, raw_length=len(swa), nodes=nodes)
        if self._on_device(m):
            m.full_slots, m.swa_slots = self.device_slots(m)
        else:
            m.needs_load = True
        return m

    def match_exact(self, keys: list[int]) -> MatchResult:
        """Like ``match_prefix`` for ``keys`` that are all in the tree on the device with SWA KV
        for their last ``min(W, len(keys))`` positions (just inserted by a running request)."""
        path, swa = self.walk(keys, True)
        assert len(swa) == len(keys), "keys not in the tree"
        node, nodes = self.cut(path, len(keys))
        m = MatchResult(len(keys), [], [], node, raw_length=len(keys), nodes=nodes)
        m.full_slots, m.swa_slots = self.device_slots(m)
        assert NO_SLOT not in m.swa_slots[max(0, len(keys) - self.window):], "window not in the tree"
        self.touch_path(node, len(keys))
        return m

    def peek_match_len(self, keys: list[int]) -> int:
        """Window-safe match length without side effects (for scheduling policies)."""
        _, swa = self.walk(keys, False)
        return self._safe_length(swa, len(swa), ())

    def peek_raw_len(self, keys: list[int]) -> int:
        """Keys of ``keys`` present in the tree with full KV in some tier (no side effects)."""
        _, swa = self.walk(keys, False)
        return len(swa)

    def walk(self, keys: list[int], device_only: bool) -> tuple[list[tuple[Node, int]], list[int]]:
        """The matched path and, per matched position, a SWA slot in some tier or ``NO_SLOT``
        (with ``device_only``: device slots, stopping at the first host-only node)."""
        path: list[tuple[Node, int]] = []
        swa: list[int] = []
        node, pos = self.root, 0
        while pos < len(keys):
            child = node.children.get(keys[pos])
            if child is None or (device_only and child.device.full is None):
                break
            k = common_len(child.key, keys, pos)
            path.append((child, k))
            host = child.host
            dev = child.device.swa[:k]
            if device_only or host is None or not host.num_swa or NO_SLOT not in dev:
                swa.extend(dev)
            else:
                swa.extend([d if d != NO_SLOT else h for d, h in zip(dev, host.swa[:k])])
            pos += k
            if k < len(child.key):
                break
            node = child
        return path, swa

    def _safe_length(self, swa: list[int], length: int, forbidden: list[tuple[int, int]] | tuple) -> int:
        w = self.window
        ln = length
        while ln > 0:
            lo = max(0, ln - w)
            j = ln - 1
            while j >= lo and swa[j] != NO_SLOT:
                j -= 1
            if j >= lo:
                ln = j  # every end in (j, ln] has the tombstone at j inside its window
                continue
            bad = [s for s, e in forbidden if s < ln < e]
            if not bad:
                return ln
            ln = min(bad)
        return 0

    def cut(self, path: list[tuple[Node, int]], length: int) -> tuple[Node, list[Node]]:
        """Split the path's nodes so that one ends exactly at ``length``; returns it and the path."""
        node, pos = self.root, 0
        nodes: list[Node] = []
        for child, k in path:
            if pos >= length:
                break
            take = min(k, length - pos)
            if take < len(child.key):
                child = self._split(child, take)
            nodes.append(child)
            pos += take
            node = child
        assert pos == length
        return node, nodes

    def window_positions(self, m: MatchResult):
        """``(node, index)`` of the last ``min(W, length)`` positions of the match, last first."""
        need = min(self.window, m.length)
        for n in reversed(m.nodes):
            for i in range(len(n.key) - 1, -1, -1):
                if need == 0:
                    return
                yield n, i
                need -= 1

    def _on_device(self, m: MatchResult) -> bool:
        if any(n.device.full is None for n in m.nodes):
            return False
        return all(n.device.swa[i] != NO_SLOT for n, i in self.window_positions(m))

    def device_slots(self, m: MatchResult) -> tuple[list[int], list[int]]:
        """A match's device ``(full, swa)`` slots (SWA ``NO_SLOT`` before its window)."""
        full: list[int] = []
        swa: list[int] = []
        for n in m.nodes:
            full.extend(n.device.full)
            swa.extend(n.device.swa)
        lo = max(0, m.length - self.window)
        swa[:lo] = [NO_SLOT] * lo
        return full, swa

    def touch_path(self, node: Node, length: int) -> None:
        """Mark the path to ``node`` (a match of ``length``) and its window recently used."""
        tick = next(self._clock)
        n = node
        while n is not self.root:
            n.last_access = tick
            n = n.parent
        self._touch_swa(node, length, tick)

    def _touch_swa(self, node: Node, length: int, tick: int) -> None:
        covered, need = 0, min(self.window, length)
        while node is not self.root and covered < need:
            node.swa_access = tick
            covered += len(node.key)
            node = node.parent

    # ------------------------------------------------------------------ structure
    def add_child(self, parent: Node, key: list[int]) -> Node:
        """A new node under ``parent`` holding no slots yet (give it some with a tier's ``set``)."""
        node = Node(key, parent, self.host is not None)
        parent.children[key[0]] = node
        self._nodes.add(node)
        return node

    def _split(self, node: Node, k: int) -> Node:
        """Cut ``node`` after ``k`` tokens; returns the new prefix node (the suffix keeps ``node``)."""
        assert 0 < k < len(node.key)
        pre = self.add_child(node.parent, node.key[:k])
        # both halves carry the same locks, set while ``pre`` holds no slots: the tiers count
        # its locked slots as its slots are set below
        pre.full_lock = node.full_lock
        pre.swa_holders = set(node.swa_holders)
        for h in pre.swa_holders:  # conservative: holders of the suffix also pin the prefix
            h.swa_nodes.append(pre)
        pre.last_access, pre.swa_access = node.last_access, node.swa_access
        node.key = node.key[k:]
        pre.children[node.key[0]] = node
        node.parent = pre
        for tier in self.tiers:
            rec = tier.record(node)
            full, swa = rec.full, rec.swa
            tier.set(node, full=None if full is None else full[k:], swa=swa[k:])
            tier.set(pre, full=None if full is None else full[:k], swa=swa[:k])
        return pre

    def remove_leaf(self, node: Node) -> tuple[int, int]:
        """Remove a childless, unlocked node from the tree, freeing its slots in every tier;
        returns the device ``(full, swa)`` slots freed."""
        assert not node.children and node.full_lock == 0 and not node.swa_holders
        freed = self.device.release(node)
        if self.host is not None:
            self.host.release(node)
        del node.parent.children[node.key[0]]
        node.parent = None
        self._nodes.discard(node)
        self.stats["node_evictions"] += 1
        return freed

    # ------------------------------------------------------------------ locking
    def lock(self, match: MatchResult) -> LockHandle:
        """Pin the path to ``match.last_node`` (full) and the SWA of its last ``W`` tokens."""
        node = match.last_node
        h = LockHandle(node)
        n = node
        while n is not self.root:
            self.device.pin_full(n)
            n = n.parent
        covered, need = 0, min(self.window, match.length)
        n = node
        while n is not self.root and covered < need:
            self.device.pin_swa(n, h)
            h.swa_nodes.append(n)
            covered += len(n.key)
            n = n.parent
        return h

    def unlock_swa(self, h: LockHandle) -> None:
        """Drop the SWA pin (the holder no longer reads these SWA slots). Idempotent."""
        for n in h.swa_nodes:
            self.device.unpin_swa(n, h)
        h.swa_nodes = []

    def unlock(self, h: LockHandle) -> None:
        """Drop both pins. Idempotent."""
        self.unlock_swa(h)
        if h.full_locked:
            n = h.node
            while n is not self.root:
                self.device.unpin_full(n)
                n = n.parent
            h.full_locked = False

    # ------------------------------------------------------------------ insertion
    def insert(self, keys: list[int], full: list[int], swa: list[int], owned_from: int = 0) -> int:
        """Cache a computed sequence (device slots); returns how many tokens were newly added.

        ``full``/``swa`` give slots for every position of ``keys`` (``swa`` -1 where not held).
        Positions ``< owned_from`` are already the tree's (a locked match) and are only walked.
        The tree takes or frees every caller slot at ``>= owned_from``: afterwards the caller owns
        none of them. A host-only node on the way takes the caller's slots as its device copy.
        """
        n_tok = len(keys)
        assert len(full) == len(swa) == n_tok and 0 <= owned_from <= n_tok
        device = self.device
        dup_full: list[int] = []
        dup_swa: list[int] = []
        node, pos, added = self.root, 0, 0
        tick = next(self._clock)
        while pos < n_tok:
            child = node.children.get(keys[pos])
            if child is None:
                assert pos >= owned_from, "locked prefix missing from the tree"
                new = self.add_child(node, list(keys[pos:]))
                device.set(new, full=list(full[pos:]), swa=list(swa[pos:]))
                added = n_tok - pos
                node, pos = new, n_tok
                node.last_access = tick
                break
            k = common_len(child.key, keys, pos)
            if k < len(child.key):
                child = self._split(child, k)
            rec = child.device
            if rec.full is None:  # host-only: the caller's KV becomes its device copy
                assert pos >= owned_from, "locked prefix not on the device"
                device.set(child, full=list(full[pos:pos + k]), swa=list(swa[pos:pos + k]))
            else:
                revived: list[int] = []
                for i in range(k):
                    p = pos + i
                    if p < owned_from:
                        assert rec.full[i] == full[p], "caller's cached prefix differs from the tree"
                        continue
                    assert rec.full[i] != full[p]
                    dup_full.append(full[p])
                    if swa[p] != NO_SLOT:
                        if rec.swa[i] == NO_SLOT:
                            revived.append(i)  # the caller's SWA revives the tombstone
                        else:
                            dup_swa.append(swa[p])
                if revived:
                    device.put_swa(child, revived, [swa[pos + i] for i in revived])
                    self.stats["revived_tokens"] += len(revived)
            child.last_access = tick
            node, pos = child, pos + k
        self._touch_swa(node, n_tok, tick)
        device.full_pool.free(dup_full)
        device.swa_pool.free(dup_swa)
        return added

    # ------------------------------------------------------------------ checks
    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    def owned_slots(self) -> tuple[list[int], list[int]]:
        """Device ``(full, swa)`` slots owned by the tree."""
        return self.device.owned_slots(self._nodes)

    def owned_host_slots(self) -> tuple[list[int], list[int]]:
        return ([], []) if self.host is None else self.host.owned_slots(self._nodes)

    def check_integrity(self) -> None:
        """Raise AssertionError if the tree's structure, tiers or counters are inconsistent."""
        seen: set[Node] = set()
        stack = [self.root]
        while stack:
            n = stack.pop()
            for k, c in n.children.items():
                assert c.parent is n, "bad parent pointer"
                assert c.key and c.key[0] == k, "child key mismatch"
                assert (c.host is None) == (self.host is None), "host KV without a host tier"
                on_device = c.device.full is not None
                assert on_device or (c.host is not None and c.host.full is not None), "node with full KV in no tier"
                assert not on_device or n is self.root or n.device.full is not None, \
                    "device residency not top-closed"
                assert 0 <= c.full_lock <= n.full_lock or n is self.root, "child locked more than parent"
                if c.swa_holders:
                    assert c.full_lock > 0, "SWA-locked node without full lock"
                seen.add(c)
                stack.append(c)
        assert seen == self._nodes, "node registry differs from the tree"
        for tier in self.tiers:
            tier.check(seen)
