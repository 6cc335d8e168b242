"""The radix tree's node, its per-tier slot records, and the records the tree hands out (see
``llm_svc.kv.radix``)."""

from __future__ import annotations

from dataclasses import dataclass, field

NO_SLOT = -1


class TierSlots:
    """A node's KV in one tier: ``full`` slots (one per token, or ``None`` when this tier holds
    none of the node's full KV) and ``swa`` slots (one per token, ``NO_SLOT`` where this tier
    holds no SWA KV), ``num_swa`` of them valid. Changed only through ``Tier.set`` (which keeps
    the tier's counters and indexes in step)."""

    __slots__ = ("full", "swa", "num_swa")

    def __init__(self, n_tokens: int) -> None:
        self.full: list[int] | None = None
        self.swa: list[int] = [NO_SLOT] * n_tokens
        self.num_swa = 0


class Node:
    """A run of tokens (``key``, one int per token) with its KV in each tier of the tree: the
    ``device`` record, and the ``host`` record (``None`` when the tree has no host tier).

    Full KV is per node: at least one tier holds all of it. ``full_lock`` counts holders of this
    node's path; ``swa_holders`` pin its device SWA slots. ``last_access`` / ``swa_access``: the
    tree's clock when the node's full KV / SWA window was last needed."""

    __slots__ = (
        "key", "device", "host", "children", "parent", "full_lock", "swa_holders", "last_access", "swa_access",
    )

    def __init__(self, key: list[int], parent: "Node | None", with_host: bool) -> None:
        self.key = key
        self.device = TierSlots(len(key))
        self.host = TierSlots(len(key)) if with_host else None
        self.children: dict[int, Node] = {}
        self.parent = parent
        self.full_lock = 0
        self.swa_holders: set[LockHandle] = set()
        self.last_access = 0
        self.swa_access = 0

    def has_device_child(self) -> bool:
        return any(c.device.full is not None for c in self.children.values())


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


_BLOCK = 64


def common_len(a: list[int], b: list[int], b_start: int) -> int:
    """Length of the common prefix of ``a`` and ``b[b_start:]``. List slices compare in C: the
    whole overlap at once (the usual case, a node matched to its end), else blocks of 64 up to
    the first that differs, then that block key by key (a Python loop over a few-thousand-key
    prompt was ~0.3 ms, a few percent of an agent trace's engine time in the scheduler)."""
    n = min(len(a), len(b) - b_start)
    if a[:n] == b[b_start:b_start + n]:
        return n
    i = 0
    while i + _BLOCK <= n and a[i:i + _BLOCK] == b[b_start + i:b_start + i + _BLOCK]:
        i += _BLOCK
    while i < n and a[i] == b[b_start + i]:
        i += 1
    return i
