"""SWA-aware radix prefix cache over two tiers: the device pools (L1) and host pools (L2).

Keys are per-token ints (token ids, or media-hash keys at placeholder positions). Each node
holds, per token, a full-pool slot and a SWA-pool slot or ``-1`` (a *tombstone*: SWA KV freed,
full KV kept), on the device and/or on the host. Contract:

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
"""

from __future__ import annotations

import itertools

from llm_svc.kv.pool import SlotPool
from llm_svc.kv.radix_evict import EvictionMixin
from llm_svc.kv.radix_host import HostMixin
from llm_svc.kv.radix_node import NO_SLOT, LockHandle, MatchResult, Node, common_len

__all__ = ["NO_SLOT", "LockHandle", "MatchResult", "Node", "RadixCache"]


class RadixCache(EvictionMixin, HostMixin):
    """The tree over two device ``SlotPool``s and, optionally, two host ones."""

    def __init__(self, window: int, full_pool: SlotPool, swa_pool: SlotPool,
                 host_full_pool: SlotPool | None = None, host_swa_pool: SlotPool | None = None) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        if (host_full_pool is None) != (host_swa_pool is None):
            raise ValueError("the host tier needs both a full and a SWA pool")
        self.window = window
        self.full_pool = full_pool
        self.swa_pool = swa_pool
        self.host_full_pool = host_full_pool
        self.host_swa_pool = host_swa_pool
        self.root = Node([], [], [], None)
        self.root.full_lock = 1  # never evicted
        self._nodes: set[Node] = set()
        # the nodes holding device / host SWA (num_swa / num_hswa > 0): SWA eviction picks among
        # these, not among every node (most nodes' windows are long gone; the tree grows to tens
        # of thousands of nodes and SWA is asked for on every step)
        self._swa_nodes: set[Node] = set()
        self._hswa_nodes: set[Node] = set()
        # likewise for full KV: the device leaves (device full KV, no child on the device: the
        # only nodes device eviction may take) and the nodes with a host copy of their full KV
        self._leaves: set[Node] = set()
        self._hfull_nodes: set[Node] = set()
        self._clock = itertools.count(1)
        self.full_tokens = 0  # device full slots owned by the tree
        self.swa_tokens = 0  # device SWA slots owned by the tree
        self.host_full_tokens = 0
        self.host_swa_tokens = 0
        self.locked_full = 0  # device full slots in nodes with full_lock > 0
        self.locked_swa = 0  # device SWA slots in nodes with SWA holders
        # (kind, src slots, dst slots), kind in h2d_full / h2d_swa / d2h_full / d2h_swa
        self.ops: list[tuple[str, list[int], list[int]]] = []
        self.stats = {
            "node_evictions": 0, "swa_evictions": 0, "revived_tokens": 0,
            "demoted_full": 0, "demoted_swa": 0, "loaded_full": 0, "loaded_swa": 0,
            "host_evictions": 0, "host_swa_evictions": 0, "host_inserted_full": 0, "host_inserted_swa": 0,
            "eviction_scans": 0,  # passes over an eviction index (its candidates put in a heap)
        }

    @property
    def host_enabled(self) -> bool:
        return self.host_full_pool is not None

    def take_ops(self) -> list[tuple[str, list[int], list[int]]]:
        ops, self.ops = self.ops, []
        return ops

    # ------------------------------------------------------------------ matching
    def match_prefix(self, keys: list[int], forbidden_ends: list[tuple[int, int]] = (),
                     device_only: bool = False) -> MatchResult:
        """Longest window-safe cached prefix of ``keys`` (in any tier, or on the device only);
        an end ``L`` with ``s < L < e`` for a ``(s, e)`` in ``forbidden_ends`` is not allowed
        either (e.g. inside a bidirectional span). Splits the node at ``L`` and marks the path
        recently used. Does not lock."""
        path, swa = self._walk(keys, device_only)
        length = self._safe_length(swa, len(swa), forbidden_ends)
        node, nodes = self._cut(path, length)
        self._touch_path(node, length)
        m = MatchResult(length, [], [], node, raw_length=len(swa), nodes=nodes)
        if self._on_device(m):
            m.full_slots, m.swa_slots = self._device_slots(m)
        else:
            m.needs_load = True
        return m

    def match_exact(self, keys: list[int]) -> MatchResult:
        """Like ``match_prefix`` for ``keys`` that are all in the tree on the device with SWA KV
        for their last ``min(W, len(keys))`` positions (just inserted by a running request)."""
        path, swa = self._walk(keys, True)
        assert len(swa) == len(keys), "keys not in the tree"
        node, nodes = self._cut(path, len(keys))
        m = MatchResult(len(keys), [], [], node, raw_length=len(keys), nodes=nodes)
        m.full_slots, m.swa_slots = self._device_slots(m)
        assert NO_SLOT not in m.swa_slots[max(0, len(keys) - self.window):], "window not in the tree"
        self._touch_path(node, len(keys))
        return m

    def peek_match_len(self, keys: list[int]) -> int:
        """Window-safe match length without side effects (for scheduling policies)."""
        _, swa = self._walk(keys, False)
        return self._safe_length(swa, len(swa), ())

    def peek_raw_len(self, keys: list[int]) -> int:
        """Keys of ``keys`` present in the tree with full KV in some tier (no side effects)."""
        _, swa = self._walk(keys, False)
        return len(swa)

    def _walk(self, keys: list[int], device_only: bool) -> tuple[list[tuple[Node, int]], list[int]]:
        """The matched path and, per matched position, a SWA slot in some tier or ``NO_SLOT``
        (with ``device_only``: device slots, stopping at the first host-only node)."""
        path: list[tuple[Node, int]] = []
        swa: list[int] = []
        node, pos = self.root, 0
        while pos < len(keys):
            child = node.children.get(keys[pos])
            if child is None or (device_only and child.full is None):
                break
            k = common_len(child.key, keys, pos)
            path.append((child, k))
            if device_only or child.hswa is None:
                swa.extend(child.swa[:k])
            else:
                swa.extend(d if d != NO_SLOT else h for d, h in zip(child.swa[:k], child.hswa[:k]))
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

    def _cut(self, path: list[tuple[Node, int]], length: int) -> tuple[Node, list[Node]]:
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

    def _window_positions(self, m: MatchResult):
        """``(node, index)`` of the last ``min(W, length)`` positions of the match, last first."""
        need = min(self.window, m.length)
        for n in reversed(m.nodes):
            for i in range(len(n.key) - 1, -1, -1):
                if need == 0:
                    return
                yield n, i
                need -= 1

    def _on_device(self, m: MatchResult) -> bool:
        if any(n.full is None for n in m.nodes):
            return False
        return all(n.swa[i] != NO_SLOT for n, i in self._window_positions(m))

    def _device_slots(self, m: MatchResult) -> tuple[list[int], list[int]]:
        full: list[int] = []
        swa: list[int] = []
        for n in m.nodes:
            full.extend(n.full)
            swa.extend(n.swa)
        lo = max(0, m.length - self.window)
        swa[:lo] = [NO_SLOT] * lo
        return full, swa

    def _touch_path(self, node: Node, length: int) -> None:
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

    def _split(self, node: Node, k: int) -> Node:
        """Cut ``node`` after ``k`` tokens; returns the new prefix node (the suffix keeps ``node``)."""
        assert 0 < k < len(node.key)
        parent = node.parent
        pre = Node(node.key[:k], None if node.full is None else node.full[:k], node.swa[:k], parent,
                   None if node.hfull is None else node.hfull[:k], None if node.hswa is None else node.hswa[:k])
        node.key, node.swa = node.key[k:], node.swa[k:]
        if node.full is not None:
            node.full = node.full[k:]
        if node.hfull is not None:
            node.hfull = node.hfull[k:]
        if node.hswa is not None:
            node.hswa = node.hswa[k:]
        node.num_swa -= pre.num_swa
        node.num_hswa -= pre.num_hswa
        pre.full_lock = node.full_lock
        pre.swa_holders = set(node.swa_holders)
        for h in pre.swa_holders:  # conservative: holders of the suffix also pin the prefix
            h.swa_nodes.append(pre)
        pre.last_access, pre.swa_access = node.last_access, node.swa_access
        parent.children[pre.key[0]] = pre
        pre.children[node.key[0]] = node
        node.parent = pre
        self._nodes.add(pre)
        for n in (pre, node):
            self._reindex(n)
            self._leaf_index(n)
        # totals unchanged: both halves carry the same locks
        return pre

    # ------------------------------------------------------------------ locking
    def lock(self, match: MatchResult) -> LockHandle:
        """Pin the path to ``match.last_node`` (full) and the SWA of its last ``W`` tokens."""
        node = match.last_node
        h = LockHandle(node)
        n = node
        while n is not self.root:
            if n.full_lock == 0 and n.full is not None:
                self.locked_full += len(n.key)
            n.full_lock += 1
            n = n.parent
        covered, need = 0, min(self.window, match.length)
        n = node
        while n is not self.root and covered < need:
            if not n.swa_holders:
                self.locked_swa += n.num_swa
            n.swa_holders.add(h)
            h.swa_nodes.append(n)
            covered += len(n.key)
            n = n.parent
        return h

    def unlock_swa(self, h: LockHandle) -> None:
        """Drop the SWA pin (the holder no longer reads these SWA slots). Idempotent."""
        for n in h.swa_nodes:
            n.swa_holders.discard(h)
            if not n.swa_holders:
                self.locked_swa -= n.num_swa
        h.swa_nodes = []

    def unlock(self, h: LockHandle) -> None:
        """Drop both pins. Idempotent."""
        self.unlock_swa(h)
        if h.full_locked:
            n = h.node
            while n is not self.root:
                n.full_lock -= 1
                assert n.full_lock >= 0
                if n.full_lock == 0 and n.full is not None:
                    self.locked_full -= len(n.key)
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
        dup_full: list[int] = []
        dup_swa: list[int] = []
        node, pos, added = self.root, 0, 0
        tick = next(self._clock)
        while pos < n_tok:
            child = node.children.get(keys[pos])
            if child is None:
                assert pos >= owned_from, "locked prefix missing from the tree"
                new = Node(list(keys[pos:]), list(full[pos:]), list(swa[pos:]), node)
                node.children[keys[pos]] = new
                self._nodes.add(new)
                self._reindex(new)
                self._leaf_index(new)
                self._leaf_index(node)
                self.full_tokens += len(new.key)
                self.swa_tokens += new.num_swa
                added = n_tok - pos
                node, pos = new, n_tok
                node.last_access = tick
                break
            k = common_len(child.key, keys, pos)
            if k < len(child.key):
                child = self._split(child, k)
            if child.full is None:  # host-only: the caller's KV becomes its device copy
                assert pos >= owned_from, "locked prefix not on the device"
                child.full = list(full[pos:pos + k])
                self._leaf_index(child)
                self._leaf_index(child.parent)
                self.full_tokens += k
                if child.full_lock:
                    self.locked_full += k
                for i in range(k):
                    if swa[pos + i] != NO_SLOT:
                        self._set_swa(child, i, swa[pos + i])
            else:
                for i in range(k):
                    p = pos + i
                    if p < owned_from:
                        assert child.full[i] == full[p], "caller's cached prefix differs from the tree"
                        continue
                    assert child.full[i] != full[p]
                    dup_full.append(full[p])
                    if swa[p] != NO_SLOT:
                        if child.swa[i] == NO_SLOT:
                            self._set_swa(child, i, swa[p])  # revive the tombstone
                            self.stats["revived_tokens"] += 1
                        else:
                            dup_swa.append(swa[p])
            child.last_access = tick
            node, pos = child, pos + k
        self._touch_swa(node, n_tok, tick)
        self.full_pool.free(dup_full)
        self.swa_pool.free(dup_swa)
        return added

    def _set_swa(self, node: Node, i: int, slot: int) -> None:
        was = node.swa[i] != NO_SLOT
        now = slot != NO_SLOT
        node.swa[i] = slot
        delta = int(now) - int(was)
        node.num_swa += delta
        self.swa_tokens += delta
        if node.swa_holders:
            self.locked_swa += delta
        self._reindex(node)

    def _reindex(self, node: Node) -> None:
        """Keep ``node``'s membership of the device / host SWA indexes and of the host full index
        in step with its counts and copies (call after any change to them)."""
        (self._swa_nodes.add if node.num_swa else self._swa_nodes.discard)(node)
        (self._hswa_nodes.add if node.num_hswa else self._hswa_nodes.discard)(node)
        (self._hfull_nodes.add if node.hfull is not None else self._hfull_nodes.discard)(node)

    def _leaf_index(self, node: Node) -> None:
        """Keep ``node``'s membership of the device-leaf index in step (call for a node whose
        device full KV changed, and for its parent; for the parent of an added or removed child)."""
        if node is self.root:
            return
        leaf = node.parent is not None and node.full is not None and not node.has_device_child()
        (self._leaves.add if leaf else self._leaves.discard)(node)

    # ------------------------------------------------------------------ checks
    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    def owned_slots(self) -> tuple[list[int], list[int]]:
        """Device ``(full, swa)`` slots owned by the tree."""
        full: list[int] = []
        swa: list[int] = []
        for n in self._nodes:
            if n.full is not None:
                full.extend(n.full)
            swa.extend(s for s in n.swa if s != NO_SLOT)
        return full, swa

    def owned_host_slots(self) -> tuple[list[int], list[int]]:
        full: list[int] = []
        swa: list[int] = []
        for n in self._nodes:
            if n.hfull is not None:
                full.extend(n.hfull)
            if n.hswa is not None:
                swa.extend(s for s in n.hswa if s != NO_SLOT)
        return full, swa

    def check_integrity(self) -> None:
        """Raise AssertionError if the tree's structure, tiers or counters are inconsistent."""
        seen: set[Node] = set()
        full_tokens = swa_tokens = locked_full = locked_swa = hfull_tokens = hswa_tokens = 0
        stack = [self.root]
        while stack:
            n = stack.pop()
            for k, c in n.children.items():
                assert c.parent is n, "bad parent pointer"
                assert c.key and c.key[0] == k, "child key mismatch"
                assert len(c.key) == len(c.swa), "node lengths differ"
                assert c.full is None or len(c.full) == len(c.key), "device full length differs"
                assert c.hfull is None or len(c.hfull) == len(c.key), "host full length differs"
                assert c.hswa is None or len(c.hswa) == len(c.key), "host SWA length differs"
                assert c.full is not None or c.hfull is not None, "node with full KV in no tier"
                assert c.full is None or n is self.root or n.full is not None, "device residency not top-closed"
                if c.full is None:
                    assert c.num_swa == 0, "device SWA without device full KV"
                assert c.num_swa == sum(s != NO_SLOT for s in c.swa), "num_swa stale"
                assert c.num_hswa == (sum(s != NO_SLOT for s in c.hswa) if c.hswa else 0), "num_hswa stale"
                assert 0 <= c.full_lock <= n.full_lock or n is self.root, "child locked more than parent"
                if c.swa_holders:
                    assert c.full_lock > 0, "SWA-locked node without full lock"
                if c.full is not None:
                    full_tokens += len(c.key)
                    locked_full += len(c.key) if c.full_lock else 0
                swa_tokens += c.num_swa
                locked_swa += c.num_swa if c.swa_holders else 0
                hfull_tokens += len(c.key) if c.hfull is not None else 0
                hswa_tokens += c.num_hswa
                seen.add(c)
                stack.append(c)
        assert seen == self._nodes, "node registry differs from the tree"
        assert self._swa_nodes == {n for n in seen if n.num_swa}, "device SWA index stale"
        assert self._hswa_nodes == {n for n in seen if n.num_hswa}, "host SWA index stale"
        assert self._hfull_nodes == {n for n in seen if n.hfull is not None}, "host full index stale"
        assert self._leaves == {n for n in seen if n.full is not None and not n.has_device_child()}, \
            "device leaf index stale"
        assert (full_tokens, swa_tokens, locked_full, locked_swa, hfull_tokens, hswa_tokens) == (
            self.full_tokens, self.swa_tokens, self.locked_full, self.locked_swa,
            self.host_full_tokens, self.host_swa_tokens,
        ), "tree counters stale"
        for owned in (self.owned_slots(), self.owned_host_slots()):
            for slots in owned:
                assert len(set(slots)) == len(slots), "a slot is owned twice in the tree"
        if not self.host_enabled:
            assert hfull_tokens == hswa_tokens == 0, "host KV without a host tier"
