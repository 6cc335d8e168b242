"""KV events: which router block keys (``shared.prefix_keys``) this replica's prefix tree holds.

The engine core ``expect``s a request's keys with the prompt position each one needs
(``key_positions``) and ``settle``s them when the request ends: a key the tree then holds is
*stored*. ``poll`` returns what was stored and removed since the last call; after the tree
evicted anything it re-checks the held keys a bounded number of tokens per call, so a removal
is reported a few calls later, never by a pause of the engine loop.

A key is held when the tree has the full KV of its first ``t`` tokens (device or host) and a
window-safe point at most ``slack`` tokens before ``t``: a prefix whose SWA windows are all gone
(tombstoned) is not a hit, since a match would stop far before it. ``slack`` is the retention
interval of SWA windows (``swa_retention_interval``), at least the window.

Pure bookkeeping over ``RadixCache.walk``; no tensors, no I/O."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from llm_svc.kv.radix import NO_SLOT, RadixCache

EVICTION_STATS = ("node_evictions", "swa_evictions", "host_evictions", "host_swa_evictions")


@dataclass(eq=False)
class _Group:
    """One request's token keys and the router keys that depend on them: ``(key, t)``."""

    tokens: list[int]
    anchors: list[tuple[int, int]] = field(default_factory=list)


def held_positions(tree: RadixCache, tokens: list[int], ts: list[int], slack: int) -> list[bool]:
    """Per ``t`` in ``ts``: does the tree hold ``tokens[:t]`` (full KV, and a window-safe end
    in ``[t - slack, t]``)?"""
    if not ts:
        return []
    _, swa = tree.walk(tokens[: max(ts)], False)
    raw, w = len(swa), tree.window
    safe_upto = [0] * (raw + 1)  # the latest window-safe end <= L
    last_gap = -1
    for L in range(1, raw + 1):
        if swa[L - 1] == NO_SLOT:
            last_gap = L - 1
        safe = last_gap < max(0, L - w)
        safe_upto[L] = L if safe else safe_upto[L - 1]
    return [t <= raw and safe_upto[t] > 0 and safe_upto[t] >= t - slack for t in ts]


class KVKeyTracker:
    """Router keys the tree holds, and the stored / removed ones not yet taken by ``poll``.

    ``capacity`` bounds the keys tracked (the oldest requests' keys are dropped, as removed);
    ``check_tokens`` bounds the tokens re-walked per ``poll`` after an eviction."""

    def __init__(self, tree: RadixCache, slack: int, capacity: int = 65536, check_tokens: int = 32768) -> None:
        if capacity < 1 or check_tokens < 1:
            raise ValueError("capacity and check_tokens must be >= 1")
        self.tree = tree
        self.slack = max(slack, tree.window)
        self.capacity = capacity
        self.check_tokens = check_tokens
        self._pending: dict[str, _Group] = {}
        self._groups: OrderedDict[int, _Group] = OrderedDict()  # id(group) -> group, oldest first
        self._owner: dict[int, _Group] = {}  # held key -> the group it is checked in
        self._stored: set[int] = set()
        self._removed: set[int] = set()
        self._seen_evictions = self._evictions()
        self._recheck: list[_Group] = []  # groups still to re-check since the last eviction

    def __len__(self) -> int:
        return len(self._owner)

    def held(self) -> set[int]:
        return set(self._owner)

    def expect(self, request_id: str, tokens: list[int], anchors: list[tuple[int, int]]) -> None:
        """Request ``request_id`` (prefix-cache keys ``tokens``) carries router keys ``anchors``."""
        if anchors:
            self._pending[request_id] = _Group(tokens, sorted(anchors, key=lambda a: a[1]))

    def settle(self, request_id: str) -> None:
        """The request ended: its keys the tree holds are stored (a key already held moves to
        this request's tokens, the newest copy)."""
        g = self._pending.pop(request_id, None)
        if g is None:
            return
        ok = held_positions(self.tree, g.tokens, [t for _, t in g.anchors], self.slack)
        g.anchors = [a for a, good in zip(g.anchors, ok) if good]
        for key, _ in g.anchors:
            old = self._owner.get(key)
            if old is not None:
                old.anchors = [a for a in old.anchors if a[0] != key]
                if not old.anchors:
                    self._groups.pop(id(old), None)
            else:
                self._note(key, stored=True)
            self._owner[key] = g
        if g.anchors:
            self._groups[id(g)] = g
        while len(self._owner) > self.capacity:
            self._drop(next(iter(self._groups.values())))

    def poll(self) -> tuple[list[int], list[int]]:
        """``(stored, removed)`` since the last call (a key stored then removed meanwhile is in
        neither)."""
        ev = self._evictions()
        if ev != self._seen_evictions:
            self._seen_evictions = ev
            self._recheck = list(self._groups.values())
        budget = self.check_tokens
        while self._recheck and budget > 0:
            g = self._recheck.pop()
            if not g.anchors:
                self._groups.pop(id(g), None)
                continue
            budget -= g.anchors[-1][1]
            ok = held_positions(self.tree, g.tokens, [t for _, t in g.anchors], self.slack)
            for (key, _), good in zip(g.anchors, ok):
                if not good:
                    del self._owner[key]
                    self._note(key, stored=False)
            g.anchors = [a for a, good in zip(g.anchors, ok) if good]
            if not g.anchors:
                self._groups.pop(id(g), None)
        stored, removed = sorted(self._stored), sorted(self._removed)
        self._stored, self._removed = set(), set()
        return stored, removed

    def _drop(self, g: _Group) -> None:
        for key, _ in g.anchors:
            if self._owner.get(key) is g:
                del self._owner[key]
                self._note(key, stored=False)
        g.anchors = []
        self._groups.pop(id(g), None)

    def _note(self, key: int, stored: bool) -> None:
        mine, other = (self._stored, self._removed) if stored else (self._removed, self._stored)
        if key in other:
            other.discard(key)  # stored and removed within one poll: nothing to say
        else:
            mine.add(key)

    def _evictions(self) -> tuple[int, ...]:
        return tuple(self.tree.stats[k] for k in EVICTION_STATS)

    def check_integrity(self) -> None:
        """Raise AssertionError if a held key is not in its group or a group is untracked."""
        for key, g in self._owner.items():
            assert any(a[0] == key for a in g.anchors), "held key missing from its group"
            assert id(g) in self._groups, "held key in an untracked group"
        for g in self._groups.values():
            for key, _ in g.anchors:
                assert self._owner.get(key) is g, "group anchor not owned"
        assert len(self._owner) <= self.capacity
        assert not (self._stored & self._removed)
