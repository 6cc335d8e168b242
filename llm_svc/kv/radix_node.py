"""The radix tree's node and the records it hands out (see ``llm_svc.kv.radix``)."""

from __future__ import annotations

from dataclasses import dataclass, field

NO_SLOT = -1


class Node:
    """A run of tokens: per token a key, a device full slot and a device SWA slot or ``NO_SLOT``
    (tombstone), and the same two in host memory (the L2 tier).

    Full KV lives per node: ``full`` is ``None`` when the node's full KV left the device
    (demoted), ``hfull`` is ``None`` when the host holds none; at least one of them is set. SWA KV
    lives per token in either tier. ``full_lock`` counts holders of this node's path;
    ``swa_holders`` pin its device SWA slots."""

    __slots__ = (
        "key", "full", "swa", "num_swa", "hfull", "hswa", "num_hswa", "children", "parent",
        "full_lock", "swa_holders", "last_access", "swa_access",
    )

    def __init__(self, key: list[int], full: list[int] | None, swa: list[int], parent: "Node | None",
                 hfull: list[int] | None = None, hswa: list[int] | None = None) -> None:
        self.key = key
        self.full = full
        self.swa = swa
        self.num_swa = sum(s != NO_SLOT for s in swa)
        self.hfull = hfull
        self.hswa = hswa  # None: no host SWA for any token
        self.num_hswa = sum(s != NO_SLOT for s in hswa) if hswa else 0
        self.children: dict[int, Node] = {}
        self.parent = parent
        self.full_lock = 0
        self.swa_holders: set[LockHandle] = set()
        self.last_access = 0
        self.swa_access = 0

    @property
    def on_device(self) -> bool:
        return self.full is not None

    def has_device_child(self) -> bool:
        return any(c.full is not None for c in self.children.values())


@dataclass(eq=False)
class LockHandle:
    """What ``lock`` pinned; pass it back to ``unlock_swa`` / ``unlock``."""

    node: Node
    swa_nodes: list[Node] = field(default_factory=list)
    full_locked: bool = True


@dataclass
class MatchResult:
    """``full_slots`` for positions ``0..length-1``; ``swa_slots`` likewise, valid (not -1) for
    at least the last ``min(W, length)`` positions. ``last_node`` ends exactly at ``length``.

    When part of the match is only in host memory, ``needs_load`` is True and the slot lists are
    empty until ``RadixCache.load`` has brought it back to the device."""

    length: int
    full_slots: list[int]
    swa_slots: list[int]
    last_node: Node
    raw_length: int = 0  # keys matched before window-safety clipping (a known branch point)
    nodes: list[Node] = field(default_factory=list)  # the path, root excluded
    needs_load: bool = False


def common_len(a: list[int], b: list[int], b_start: int) -> int:
    """Length of the common prefix of ``a`` and ``b[b_start:]``."""
    n = min(len(a), len(b) - b_start)
    i = 0
    while i < n and a[i] == b[b_start + i]:
        i += 1
    return i
