"""SWA-aware radix prefix cache.

Keys are per-token ints (token ids, or media-hash keys at placeholder positions). Each node
holds, per token, a full-pool slot and a SWA-pool slot or ``-1`` (a *tombstone*: SWA KV freed,
full KV kept). Contract:

* A match of length ``L`` is *window-safe*: every position in ``[max(0, L-W), L)`` has SWA KV.
  Anything longer is clipped, so a prefill resuming at ``L`` never reads freed SWA KV.
* The tree owns the slots in its nodes. ``insert`` takes ownership of the caller's slots from
  ``owned_from`` on; slots for keys already present are freed (never double-owned), and a
  caller's SWA slot over a tombstone revives it.
* Handles must be locked (``lock``) before their slots are used and unlocked when done. A full
  lock pins the whole path (never evicted); a SWA lock pins the SWA of the nodes covering the last
  ``W`` matched tokens (never tombstoned). Every holder of a node's lock also holds its ancestors'
  full lock, so an unlocked node has an unlocked subtree.
* ``evict`` frees LRU leaves whole (leaves whose last token has no SWA first: no match can end
  there) for full-pool needs, then tombstones the SWA of nodes by the time their SWA was last
  needed (a match or insert ending within ``W`` tokens of them) for SWA-pool needs, keeping the
  windows of branch points (nodes with >= 2 children) longest.
"""

from __future__ import annotations

import heapq
import itertools

from llm_svc.kv.pool import SlotPool
from llm_svc.kv.radix_node import NO_SLOT, LockHandle, MatchResult, Node, common_len

__all__ = ["NO_SLOT", "LockHandle", "MatchResult", "Node", "RadixCache"]


class RadixCache:
    """The tree over two ``SlotPool``s; see the module doc for the contract."""

    def __init__(self, window: int, full_pool: SlotPool, swa_pool: SlotPool) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self.window = window
        self.full_pool = full_pool
        self.swa_pool = swa_pool
        self.root = Node([], [], [], None)
        self.root.full_lock = 1  # never evicted
        self._nodes: set[Node] = set()
        self._clock = itertools.count(1)
        self.full_tokens = 0  # full slots owned by the tree
        self.swa_tokens = 0  # SWA slots owned by the tree
        self.locked_full = 0  # full slots in nodes with full_lock > 0
        self.locked_swa = 0  # SWA slots in nodes with SWA holders
        self.stats = {"node_evictions": 0, "swa_evictions": 0, "revived_tokens": 0}

    # ------------------------------------------------------------------ matching
    def match_prefix(self, keys: list[int], forbidden_ends: list[tuple[int, int]] = ()) -> MatchResult:
        """Longest window-safe cached prefix of ``keys``; an end ``L`` with ``s < L < e`` for a
        ``(s, e)`` in ``forbidden_ends`` is not allowed either (e.g. inside a bidirectional span).
        Splits the node at ``L`` and marks the path recently used. Does not lock."""
        path, swa = self._walk(keys)
        length = self._safe_length(swa, len(swa), forbidden_ends)
        node, full, swa_out = self._materialize(path, length)
        self._touch_path(node, length)
        return MatchResult(length, full, swa_out, node, raw_length=len(swa))

    def match_exact(self, keys: list[int]) -> MatchResult:
        """Like ``match_prefix`` for ``keys`` that are all in the tree with SWA KV for their last
        ``min(W, len(keys))`` positions (just inserted by a running request): no clipping."""
        path, swa = self._walk(keys)
        assert len(swa) == len(keys), "keys not in the tree"
        node, full, swa_out = self._materialize(path, len(keys))
        assert NO_SLOT not in swa_out[max(0, len(keys) - self.window):], "window not in the tree"
        self._touch_path(node, len(keys))
        return MatchResult(len(keys), full, swa_out, node, raw_length=len(keys))

    def _touch_path(self, node: Node, length: int) -> None:
        """Mark the path to ``node`` (a match of ``length``) and its window recently used."""
        tick = next(self._clock)
        n = node
        while n is not self.root:
            n.last_access = tick
            n = n.parent
        self._touch_swa(node, length, tick)

    def peek_match_len(self, keys: list[int]) -> int:
        """Window-safe match length without side effects (for scheduling policies)."""
        _, swa = self._walk(keys)
        return self._safe_length(swa, len(swa), ())

    def _walk(self, keys: list[int]) -> tuple[list[tuple[Node, int]], list[int]]:
        path: list[tuple[Node, int]] = []
        swa: list[int] = []
        node, pos = self.root, 0
        while pos < len(keys):
            child = node.children.get(keys[pos])
            if child is None:
                break
            k = common_len(child.key, keys, pos)
            path.append((child, k))
            swa.extend(child.swa[:k])
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

    def _materialize(self, path: list[tuple[Node, int]], length: int) -> tuple[Node, list[int], list[int]]:
        node, pos = self.root, 0
        full: list[int] = []
        swa: list[int] = []
        for child, k in path:
            if pos >= length:
                break
            take = min(k, length - pos)
            if take < len(child.key):
                child = self._split(child, take)
            full.extend(child.full)
            swa.extend(child.swa)
            pos += take
            node = child
        assert pos == length
        lo = max(0, length - self.window)
        swa[:lo] = [NO_SLOT] * lo
        return node, full, swa

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
        pre = Node(node.key[:k], node.full[:k], node.swa[:k], parent)
        node.key, node.full, node.swa = node.key[k:], node.full[k:], node.swa[k:]
        node.num_swa -= pre.num_swa
        pre.full_lock = node.full_lock
        pre.swa_holders = set(node.swa_holders)
        for h in pre.swa_holders:  # conservative: holders of the suffix also pin the prefix
            h.swa_nodes.append(pre)
        pre.last_access, pre.swa_access = node.last_access, node.swa_access
        parent.children[pre.key[0]] = pre
        pre.children[node.key[0]] = node
        node.parent = pre
        self._nodes.add(pre)
        # totals unchanged: both halves carry the same locks
        return pre

    # ------------------------------------------------------------------ locking
    def lock(self, match: MatchResult) -> LockHandle:
        """Pin the path to ``match.last_node`` (full) and the SWA of its last ``W`` tokens."""
        node = match.last_node
        h = LockHandle(node)
        n = node
        while n is not self.root:
            if n.full_lock == 0:
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
                if n.full_lock == 0:
                    self.locked_full -= len(n.key)
                n = n.parent
            h.full_locked = False

    # ------------------------------------------------------------------ insertion
    def insert(self, keys: list[int], full: list[int], swa: list[int], owned_from: int = 0) -> int:
        """Cache a computed sequence; returns how many tokens were newly added.

        ``full``/``swa`` give slots for every position of ``keys`` (``swa`` -1 where not held).
        Positions ``< owned_from`` are already the tree's (a locked match) and are only walked.
        The tree takes or frees every caller slot at ``>= owned_from``: afterwards the caller owns
        none of them.
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
                self.full_tokens += len(new.key)
                self.swa_tokens += new.num_swa
                added = n_tok - pos
                node, pos = new, n_tok
                node.last_access = tick
                break
            k = common_len(child.key, keys, pos)
            if k < len(child.key):
                child = self._split(child, k)
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

    # ------------------------------------------------------------------ eviction
    def evictable_full(self) -> int:
        return self.full_tokens - self.locked_full

    def evictable_swa(self) -> int:
        return self.swa_tokens - self.locked_swa

    def evict(self, full_needed: int, swa_needed: int) -> tuple[int, int]:
        """Free at least the asked numbers of slots if possible; returns ``(full, swa)`` freed."""
        freed_full = freed_swa = 0
        if full_needed > 0:
            heap = [self._leaf_key(n) for n in self._nodes if not n.children and n.full_lock == 0]
            heapq.heapify(heap)
            while heap and freed_full < full_needed:
                *_, node = heapq.heappop(heap)
                parent = node.parent
                f, s = self._remove_leaf(node)
                freed_full += f
                freed_swa += s
                if parent is not self.root and not parent.children and parent.full_lock == 0:
                    heapq.heappush(heap, self._leaf_key(parent))
        if swa_needed > freed_swa:
            # windows at branch points (>= 2 children: e.g. the end of a shared system prompt)
            # go last; among the rest, least recently needed first
            cands = sorted(
                (n for n in self._nodes if n.num_swa and not n.swa_holders),
                key=lambda n: (len(n.children) >= 2, n.swa_access),
            )
            for node in cands:
                if freed_swa >= swa_needed:
                    break
                freed_swa += self._tombstone(node)
        return freed_full, freed_swa

    @staticmethod
    def _leaf_key(n: Node) -> tuple:
        alive_tail = n.swa[-1] != NO_SLOT
        return (alive_tail, n.last_access, id(n), n)

    def _remove_leaf(self, node: Node) -> tuple[int, int]:
        assert not node.children and node.full_lock == 0 and not node.swa_holders
        del node.parent.children[node.key[0]]
        self._nodes.discard(node)
        swa = [s for s in node.swa if s != NO_SLOT]
        self.full_pool.free(node.full)
        self.swa_pool.free(swa)
        self.full_tokens -= len(node.full)
        self.swa_tokens -= len(swa)
        node.parent = None
        self.stats["node_evictions"] += 1
        return len(node.full), len(swa)

    def _tombstone(self, node: Node) -> int:
        assert not node.swa_holders
        swa = [s for s in node.swa if s != NO_SLOT]
        self.swa_pool.free(swa)
        node.swa = [NO_SLOT] * len(node.swa)
        node.num_swa = 0
        self.swa_tokens -= len(swa)
        self.stats["swa_evictions"] += 1
        return len(swa)

    # ------------------------------------------------------------------ checks
    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    def owned_slots(self) -> tuple[list[int], list[int]]:
        full: list[int] = []
        swa: list[int] = []
        for n in self._nodes:
            full.extend(n.full)
            swa.extend(s for s in n.swa if s != NO_SLOT)
        return full, swa

    def check_integrity(self) -> None:
        """Raise AssertionError if the tree's structure or counters are inconsistent."""
        seen: set[Node] = set()
        full_tokens = swa_tokens = locked_full = locked_swa = 0
        stack = [self.root]
        while stack:
            n = stack.pop()
            for k, c in n.children.items():
                assert c.parent is n, "bad parent pointer"
                assert c.key and c.key[0] == k, "child key mismatch"
                assert len(c.key) == len(c.full) == len(c.swa), "node lengths differ"
                assert c.num_swa == sum(s != NO_SLOT for s in c.swa), "num_swa stale"
                assert 0 <= c.full_lock <= n.full_lock or n is self.root, "child locked more than parent"
                if c.swa_holders:
                    assert c.full_lock > 0, "SWA-locked node without full lock"
                full_tokens += len(c.key)
                swa_tokens += c.num_swa
                locked_full += len(c.key) if c.full_lock else 0
                locked_swa += c.num_swa if c.swa_holders else 0
                seen.add(c)
                stack.append(c)
        assert seen == self._nodes, "node registry differs from the tree"
        assert (full_tokens, swa_tokens, locked_full, locked_swa) == (
            self.full_tokens, self.swa_tokens, self.locked_full, self.locked_swa,
        ), "tree counters stale"
        full, swa = self.owned_slots()
        assert len(set(full)) == len(full), "a full slot is owned twice in the tree"
        assert len(set(swa)) == len(swa), "a SWA slot is owned twice in the tree"
