"""The SWA-aware radix tree alone: exact window-safe match lengths, eviction, locks, revival."""

from __future__ import annotations

import pytest

from llm_svc.kv.pool import SlotPool
from llm_svc.kv.radix import NO_SLOT, RadixCache

pytestmark = pytest.mark.unit

W = 4


class Tree:
    """A RadixCache with its pools and a helper that inserts with a given SWA-validity mask."""

    def __init__(self, n: int = 200, window: int = W) -> None:
        self.full = SlotPool(n, "full")
        self.swa = SlotPool(n, "swa")
        self.t = RadixCache(window, self.full, self.swa)

    def insert(self, keys: list[int], swa_valid: str | None = None) -> int:
        """``swa_valid``: one char per token, '1' = SWA KV kept, '0' = tombstone."""
        mask = swa_valid or "1" * len(keys)
        assert len(mask) == len(keys)
        full = self.full.alloc(len(keys))
        swa = [self.swa.alloc(1)[0] if c == "1" else NO_SLOT for c in mask]
        return self.t.insert(keys, full, swa)

    def match(self, keys: list[int], **kw) -> int:
        return self.t.match_prefix(keys, **kw).length

    def check(self) -> None:
        """free + cached == total in both pools (no requests hold anything here)."""
        self.t.check_integrity()
        self.full.check_integrity()
        self.swa.check_integrity()
        f, s = self.t.owned_slots()
        assert sorted(f + self.full.free_slots()) == list(range(self.full.num_slots))
        assert sorted(s + self.swa.free_slots()) == list(range(self.swa.num_slots))


@pytest.fixture
def tree():
    t = Tree()
    yield t
    t.check()


def seq(n: int, base: int = 0) -> list[int]:
    return list(range(base, base + n))


def test_fully_valid_sequence_matches_exactly(tree):
    tree.insert(seq(10))
    assert tree.match(seq(10)) == 10
    assert tree.match(seq(7) + [99]) == 7
    assert tree.match(seq(12)) == 10
    assert tree.match([5, 6]) == 0


def test_released_request_matches_only_at_its_end(tree):
    # a finished request keeps SWA for its last W tokens only
    tree.insert(seq(10), "0" * 6 + "1" * 4)
    assert tree.match(seq(10)) == 10  # window [6, 10) valid
    assert tree.match(seq(11)) == 10
    assert tree.match(seq(9)) == 0  # window [5, 9) hits tombstone 5; nothing earlier is safe
    assert tree.match(seq(9) + [77]) == 0


def test_short_match_needs_every_position(tree):
    # L <= W: all of [0, L) must have SWA
    tree.insert(seq(3), "011")
    assert tree.match(seq(3)) == 0
    tree2 = Tree()
    tree2.insert(seq(3), "111")
    assert tree2.match(seq(3)) == 3
    assert tree2.match(seq(2)) == 2
    tree2.check()


def test_clip_back_over_a_tombstoned_middle(tree):
    # valid [0,2), tombstones [2,6), valid [6,12)
    tree.insert(seq(12), "11" + "0000" + "111111")
    assert tree.match(seq(12)) == 12  # window [8,12)
    assert tree.match(seq(10)) == 10  # window [6,10)
    assert tree.match(seq(9)) == 2  # [5,9) has 5; ... back to 2, whose [0,2) is valid
    assert tree.match(seq(5)) == 2
    assert tree.match(seq(2)) == 2
    assert tree.match(seq(1)) == 1


def test_window_exactly_at_tombstone_boundary(tree):
    # tombstone at position 3: an end L is safe iff L <= 3 or L - W > 3
    tree.insert(seq(12), "111" + "0" + "1" * 8)
    results = {n: tree.match(seq(n)) for n in range(1, 13)}
    assert results == {1: 1, 2: 2, 3: 3, 4: 3, 5: 3, 6: 3, 7: 3, 8: 8, 9: 9, 10: 10, 11: 11, 12: 12}


def test_match_across_nodes_and_split(tree):
    tree.insert(seq(6), "001111")
    tree.insert(seq(6) + [50, 51, 52], "000000111")
    # path: node [0..6) + node [6..9); window of 9 is [5,9): 5 valid, 6..8 valid
    m = tree.t.match_prefix(seq(6) + [50, 51, 52])
    assert m.length == 9
    assert m.swa_slots[:5] == [NO_SLOT] * 5 and NO_SLOT not in m.swa_slots[5:]
    assert len(m.full_slots) == 9 and len(set(m.full_slots)) == 9
    # a match ending inside the first node splits it at the match end
    nodes = tree.t.num_nodes
    assert tree.match(seq(5) + [99]) == 0  # [1,5): 1 is a tombstone
    assert tree.match(seq(6) + [99]) == 6  # [2,6) valid
    assert tree.t.num_nodes == nodes
    tree.insert(seq(12, 100), "1" * 12)
    assert tree.match(seq(7, 100) + [0]) == 7
    assert tree.t.num_nodes == nodes + 2  # split at 7


def test_forbidden_ends_clip_to_span_start(tree):
    tree.insert(seq(12))
    assert tree.match(seq(12), forbidden_ends=[(5, 9)]) == 12
    assert tree.match(seq(8), forbidden_ends=[(5, 9)]) == 5
    assert tree.match(seq(8), forbidden_ends=[(5, 9), (2, 6)]) == 2


def test_insert_dedupes_and_revives(tree):
    tree.insert(seq(8), "0" * 4 + "1" * 4)
    free_full, free_swa = tree.full.num_free, tree.swa.num_free
    assert tree.match(seq(6)) == 0
    # a recompute of the same keys with SWA for [2, 6): full dups freed, tombstones revived
    assert tree.insert(seq(8), "00111100") == 0
    assert tree.full.num_free == free_full  # every duplicate full slot came back
    assert tree.swa.num_free == free_swa - 2  # 2 revived (2,3); 4,5 were valid: freed
    assert tree.t.stats["revived_tokens"] == 2
    assert tree.match(seq(6)) == 6
    assert tree.insert(seq(10)) == 2  # extends by 2 new tokens


def test_eviction_lru_whole_nodes_dead_leaves_first(tree):
    a, b, c = seq(5, 10), seq(5, 20), seq(5, 30)
    tree.insert(a)
    tree.insert(b)
    tree.insert(c, "00000")  # dead leaf: no match can end in it
    tree.match(a)  # a now more recent than b
    freed = tree.t.evict(full_needed=5, swa_needed=0)
    assert freed == (5, 0)
    peek = tree.t.peek_match_len  # no LRU side effects
    assert (peek(c), peek(a), peek(b)) == (0, 5, 5)
    assert tree.t.evict(full_needed=1, swa_needed=0) == (5, 5)  # b: least recently used
    assert (peek(b), peek(a)) == (0, 5)


def test_swa_only_eviction_keeps_full_and_is_revivable(tree, monkeypatch):
    import llm_svc.kv.radix_evict as radix_evict

    monkeypatch.setattr(radix_evict, "SWA_EVICT_SLACK", 0.0)  # the order, one window at a time
    tree.insert(seq(6, 10))
    tree.insert(seq(6, 20))
    tree.match(seq(6, 10))  # its SWA was needed more recently
    full_before = tree.t.full_tokens
    assert tree.t.evict(full_needed=0, swa_needed=3) == (0, 6)
    assert tree.t.full_tokens == full_before  # tombstoned, not removed
    assert tree.match(seq(6, 20)) == 0 and tree.match(seq(6, 10)) == 6
    tree.insert(seq(6, 20), "001111")  # recompute revives the window
    assert tree.match(seq(6, 20)) == 6


def test_locked_nodes_are_never_evicted(tree):
    tree.insert(seq(8, 10))
    tree.insert(seq(8, 40))
    m = tree.t.match_prefix(seq(8, 10))
    h = tree.t.lock(m)
    assert tree.t.evictable_full() == 8
    assert tree.t.evictable_swa() == 8  # SWA of the locked window is pinned too
    assert tree.t.evict(full_needed=100, swa_needed=100) == (8, 8)
    assert tree.match(seq(8, 10)) == 8
    assert tree.t.evictable_full() == 0 and tree.t.evictable_swa() == 0
    tree.t.unlock(h)
    assert tree.t.evictable_full() == 8 and tree.t.evictable_swa() == 8
    assert tree.t.evict(full_needed=100, swa_needed=0) == (8, 8)
    assert tree.t.num_nodes == 0


def test_swa_unlock_allows_tombstoning_but_keeps_full_lock(tree):
    tree.insert(seq(10))
    h = tree.t.lock(tree.t.match_prefix(seq(10)))
    tree.t.unlock_swa(h)
    assert tree.t.evict(full_needed=10, swa_needed=0) == (0, 0)
    assert tree.t.evict(full_needed=0, swa_needed=1) == (0, 10)
    tree.t.unlock(h)
    tree.t.unlock(h)  # idempotent
    assert tree.t.locked_full == 0


def test_split_of_locked_node_unlocks_cleanly(tree):
    tree.insert(seq(12), "0" * 4 + "1" * 8)
    h = tree.t.lock(tree.t.match_prefix(seq(12)))
    # splitting the locked node twice (matches ending inside it) must not leak lock counts
    assert tree.match(seq(9) + [99]) == 9
    assert tree.match(seq(11) + [99]) == 11
    assert tree.t.num_nodes == 3
    tree.t.check_integrity()
    tree.t.unlock(h)
    assert tree.t.locked_full == 0 and tree.t.locked_swa == 0
    assert all(not n.swa_holders and n.full_lock == 0 for n in tree.t._nodes)


def test_integrity_check_catches_a_double_owned_slot(tree):
    tree.insert(seq(4))
    node = next(iter(tree.t._nodes))
    node.device.swa[1] = node.device.swa[0]
    with pytest.raises(AssertionError):
        tree.t.check_integrity()
    node.device.swa[1] = tree.swa.alloc(1)[0]  # repair (the freed-by-nobody slot 1 stays a leak) ...
    tree.t.check_integrity()
    with pytest.raises(AssertionError):
        tree.check()  # ... which the pool partition check catches
    tree.t.evict(100, 100)
    leaked = [s for s in range(tree.swa.num_slots) if s not in tree.swa.free_slots()]
    tree.swa.free(leaked)


def test_swa_eviction_keeps_branch_point_windows_longest(tree):
    system = seq(6, 500)
    tree.insert(system + [1, 2, 3, 4, 5])
    tree.insert(system + [7, 8, 9, 10, 11])  # system now ends at a node with 2 children
    tree.insert(seq(6, 900))  # an unrelated, more recently used leaf
    tree.t.evict(full_needed=0, swa_needed=1)
    # the two oldest leaves' windows go first, the branch point's window stays
    peek = tree.t.peek_match_len
    assert peek(system + [99]) == 6
    assert peek(system + [1, 2, 3, 4, 5]) in (6, 11)
    while tree.t.evictable_swa() > 6:
        tree.t.evict(full_needed=0, swa_needed=1)
    assert peek(seq(6, 900)) == 0 and peek(system + [7, 8, 9, 10, 11]) == 6
    assert peek(system + [99]) == 6  # the last window standing
