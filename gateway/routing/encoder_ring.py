"""Consistent-hash ring of encoder replicas keyed by media content hash.

The same bytes go to the same replica (whose encoder cache then hits); when a replica leaves
only its keys move.  On failure the caller walks ``candidates`` to the next distinct node."""

from __future__ import annotations

from collections.abc import Iterable

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
