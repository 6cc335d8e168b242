"""Consistent-hash ring of encoder replicas keyed by media content hash.

The same bytes go to the same replica (whose encoder cache then hits); when a replica leaves
only its keys move.  On failure the caller walks ``candidates`` to the next distinct node."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from uhashring import HashRing


class EncoderRing:
    """Routing by content hash over the current set of nodes (base URLs)."""

    def __init__(self, nodes: Iterable[str] = ()) -> None:
        self._nodes: tuple[str, ...] = ()
        self._ring = HashRing(nodes=[])
        self.set_nodes(nodes)

    def set_nodes(self, nodes: Iterable[str]) -> None:
        """Replace the node set (order does not matter: placement depends on names only)."""
        new = tuple(sorted(set(nodes)))
        if new != self._nodes:
            self._nodes = new
            self._ring = HashRing(nodes=list(new))

    def nodes(self) -> list[str]:
        return list(self._nodes)

    def owner(self, key: str) -> str | None:
        """The node that owns ``key``, or None for an empty ring."""
        return self._ring.get_node(key) if self._nodes else None

    def candidates(self, key: str, limit: int | None = None) -> list[str]:
        """Distinct nodes in ring order from ``key``'s owner: the retry order for ``key``."""
        if not self._nodes:
            return []
        out: list[str] = []
        for node in self._ring.iterate_nodes(key, distinct=True):
            out.append(node)
            if limit is not None and len(out) >= limit:
                break
        return out

    def bounded_candidates(
        self, key: str, load: Callable[[str], int], limit: int | None = None, factor: float = 1.5
    ) -> list[str]:
        """``candidates`` with bounded-load spillover (consistent hashing with bounded loads,
        as SGLang's router does): the first node in ring order whose in-flight ``load`` is below
        ``ceil(factor * mean)`` -- the mean counting this request -- comes first, so a hot item
        spills to the next node instead of piling onto its owner; the rest keep ring order."""
        order = self.candidates(key)
        if len(order) <= 1:
            return order[:limit] if limit is not None else order
        total = sum(load(n) for n in self._nodes) + 1
        cap = max(1, math.ceil(factor * total / len(self._nodes)))
        first = next((n for n in order if load(n) < cap), order[0])
        out = [first] + [n for n in order if n != first]
        return out[:limit] if limit is not None else out
